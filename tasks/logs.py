"""The logger of the driver's code: the Prefect task run's, or a plain one off a Prefect run."""

from __future__ import annotations

import logging
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError


def run_logger() -> logging.Logger | logging.LoggerAdapter[Any]:
    """The Prefect task's logger; a plain one where no Prefect run is (the fit's Ray Job on a cluster)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("prefect_raytrain.fit")


def in_prefect_run() -> bool:
    from prefect.context import TaskRunContext

    return TaskRunContext.get() is not None
