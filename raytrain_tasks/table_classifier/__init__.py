"""The table classifier: the pipeline's default ``train_code``, a ``TrainSpec`` like any user's.

It trains an MLP on a labelled table (scikit-learn's digits, a synthetic table, or your CSV/Parquet file). Its
settings are its own, in ``train_config``::

    prefect-raytrain train --train-config '{"dataset": "data/customers.csv", "label_column": "churned"}'

- ``spec``: the ``TrainSpec`` (``classifier``) and its ``Settings``.
- ``tables``, ``datasets``: loading, checking and splitting the table.
- ``data``: the prepared splits as workers read them.
- ``models``, ``reports``: the MLP, and the evaluation files logged beside the model.
"""

from raytrain_tasks.table_classifier.spec import Settings, classifier, prepare

__all__ = ["Settings", "classifier", "prepare"]
