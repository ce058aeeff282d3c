"""The pipeline's training loop for a ``TrainSpec``: what each Ray Train worker runs for one.

- ``loop``: the epochs (train, score the held-out splits, report, checkpoint) and ``as_train_func``.
- ``steps``: one batch's loss and metrics, summed across workers.
- ``data``: a spec's splits, of either kind (map-style torch datasets or Ray Datasets), sliced per worker.
- ``kept_shards``: Ray Datasets kept in the object store, divided among the workers.
- ``checkpoint``, ``resume``: what every checkpoint holds, and where a resumed loop starts.
"""
