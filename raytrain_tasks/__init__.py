"""What runs on Ray: the public API your code imports, and the pipeline's parts that run beside it.

- The public API: ``api`` (``TrainFunc``, ``TrainSpec``, ``Metric``, ``Splits``, ``checkpoint_if_preempted``).
  Nothing else here is public.
- Your code, loaded and checked: ``user_code``, ``code_rules``, ``code_settings``, ``checked_reports``, ``errors``.
- The TrainSpec loop: ``trainspec/`` (what each worker runs for a ``TrainSpec``); ``stop_requests`` (a checkpoint
  before a worker, a node or the driver goes, for a TrainSpec and a train_func alike).
- The run's settings: ``config`` (``TrainingConfig``), ``settings``, ``moved_settings``, ``environment``.
- Storage: ``storage/`` (local folders and S3), ``prepared`` (prepare-data's stored versions), ``integrity``.
- Tracking: ``tracking/`` (the MLflow run, pins, the controller's logging), ``reports``, ``failures``.
- The table classifier, the default ``train_code``: ``table_classifier/``, a TrainSpec like yours.
"""
