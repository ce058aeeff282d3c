"""Logging in a Ray Train worker of the pipeline's TrainSpec loop."""

from __future__ import annotations

import logging
import sys


def configure_worker_logging() -> None:
    """The package's one line per epoch reaches the worker's stdout (which Ray copies to the driver: the
    console with --verbose, a Ray Job's log); Ray Train's own dumps of every report do not."""
    # Ray forwards worker stdout to the driver; Ray Train's own logging config does not cover our logger.
    package_logger = logging.getLogger("raytrain_tasks")
    package_logger.setLevel(logging.INFO)
    if not package_logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        package_logger.addHandler(handler)
        package_logger.propagate = False
    # Ray Train logs every report as a raw dict dump (its logger is named after the file) and every persisted
    # checkpoint; our one line per epoch says the same, readably.
    from ray.train.v2._internal.execution import context as train_context
    from ray.train.v2._internal.execution import storage as train_storage

    for name in (train_context.__file__, train_storage.__name__):
        logging.getLogger(name).setLevel(logging.WARNING)
