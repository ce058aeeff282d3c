"""What the `prefect-raytrain` console shows without --verbose: the pipeline's own lines (progress, summary,
errors) and warnings that need the user; everything else still reaches the logs."""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

# Messages a default console leaves out (with --verbose they show): what each library says about itself.
QUIET_LOGGERS = (
    "ray._private.authentication.authentication_token_setup",  # "Token authentication is enabled ..."
    "mlflow.store.db.utils",  # "Creating initial MLflow database tables..."
    "alembic.runtime.migration",
    "ray.tune.tune",  # a sweep's "Wrote the latest version of all result files ..."
)
TEMPORARY_SERVER = ("Starting temporary server", "Stopping temporary server")


def _not_about_the_temporary_server(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(TEMPORARY_SERVER)


def quiet_console() -> None:
    """The console shows the pipeline's own lines (progress, summary, errors) and warnings that need the user.

    Nothing is lost: the output of every Ray process (the controller's worker-group lines, each worker's) stays
    in Ray's session logs (``/tmp/ray/session_latest/logs``) instead of being copied to this console, and the
    run's own log lines go to Prefect as before."""
    from raytrain_driver.cluster import LOG_TO_DRIVER_ENV

    os.environ.setdefault(LOG_TO_DRIVER_ENV, "0")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # A filter on the "prefect" logger sees only what it logs itself, not the flow and task run loggers below it.
    logging.getLogger("prefect").addFilter(_not_about_the_temporary_server)
    _one_line_run_errors()


# The loggers of Prefect's flow and task runs: their failure records carry the whole error (and the engine's
# traceback), which the command prints once, at its end.
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
ONE_LINE_CHARS = 200


def _one_line_run_errors() -> None:
    """On the console only, a flow or task run's failure is left to the command, which ends its output with the
    error once (with the user's own frames) and the command that continues the run. The records keep everything
    for the run's logs (Prefect's API handler sees them first, on the run loggers themselves) and for --verbose."""
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler" and not getattr(handler, "_prt_one_line", False):
            handler.emit = _shortened(handler.emit)  # type: ignore[method-assign]
            handler._prt_one_line = True  # type: ignore[attr-defined]


def _shortened(emit: Any) -> Any:
    def emit_one_line(record: logging.LogRecord) -> None:
        if record.name.startswith(RUN_LOGGERS):
            # A run's failure: the error it raised (with a traceback), or its final state. Other errors show.
            if record.exc_info or str(record.msg).startswith("Finished in state Failed"):
                return  # the command prints it, once
            message = record.getMessage()
            first = message.splitlines()[0] if message else ""
            if first != message or len(first) > ONE_LINE_CHARS:  # a retry: its reason, short
                record = copy.copy(record)
                record.msg = first[:ONE_LINE_CHARS] + " ... (in full: the run's logs and --verbose)"
                record.args, record.exc_info, record.exc_text = (), None, None
        emit(record)

    return emit_one_line
