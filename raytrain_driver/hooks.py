"""What the orchestrator hands the driver: its logger, its run page, its state folder; the Prefect task run's
while a Prefect task runs the driver, plain defaults elsewhere (the fit's Ray Job on a cluster, a benchmark).

The driver never imports Prefect: the task entry points (``tasks/``) hand these in with ``run_hooks``, for the
code they call in the same thread (and in threads started with a copy of its context, as
``contextvars.copy_context().run`` does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Logger = logging.Logger | logging.LoggerAdapter[Any]


@dataclass(frozen=True)
class EpochView:
    """What a run page shows of each committed epoch, as the training code decides it: ``marker``, the metric
    whose MLflow steps are the committed epochs (None: any metric the code reported with a checkpoint); ``shown``,
    the metrics each epoch's line lists (empty: every one); ``expects``, the metrics the best checkpoint and the
    gate are chosen by, warned about while the code has not reported them."""

    marker: str | None = None
    shown: tuple[str, ...] = ()
    expects: tuple[str, ...] = ()
    left_off: tuple[str, ...] = ()  # where ``shown`` is empty: names (or their starts) not listed, as ``headline``


# progress(client, run_id, epochs, logger, view): a context manager that shows the fit's epochs as they are
# committed (the Prefect task's progress artifact, tasks/run_page.py).
ProgressPage = Callable[[Any, str, int, Logger, EpochView], AbstractContextManager[Any]]


@dataclass(frozen=True)
class RunHooks:
    logger: Logger
    progress: ProgressPage | None = None
    # Where the orchestrator keeps its state on this machine (Prefect's home, PREFECT_HOME): the pin journals
    # live under it (raytrain_tasks.tracking.pins). None: read from the environment as Prefect reads it.
    state_dir: Path | None = None
    # More of Ray Train's controller callbacks for the fit (a sweep's trial: the one that reports to Ray Tune).
    controller_callbacks: tuple[Any, ...] = ()
    # Whether something outside may end the fit's process at any moment (Ray Tune stopping a sweep's trial).
    ended_from_outside: bool = False


_HOOKS: ContextVar[RunHooks | None] = ContextVar("prefect_raytrain_run_hooks", default=None)
_PLAIN = logging.getLogger("prefect_raytrain.fit")


@contextmanager
def run_hooks(hooks: RunHooks) -> Iterator[None]:
    """While active, ``run_logger()`` and ``progress_page()`` are ``hooks``'."""
    token = _HOOKS.set(hooks)
    try:
        yield
    finally:
        _HOOKS.reset(token)


def run_logger() -> Logger:
    """The calling task's logger; a plain one where no task handed one in."""
    hooks = _HOOKS.get()
    return hooks.logger if hooks is not None else _PLAIN


def progress_page() -> ProgressPage | None:
    """The run page to follow the fit on; None where there is none (a Ray Job: its submitter shows the progress)."""
    hooks = _HOOKS.get()
    return hooks.progress if hooks is not None else None


def state_dir() -> Path:
    """The orchestrator's state folder on this machine: the one handed in, else ``PREFECT_HOME`` from the
    environment, else Prefect's default ``~/.prefect`` (a fit's Ray Job on a cluster, where Prefect need not be)."""
    hooks = _HOOKS.get()
    if hooks is not None and hooks.state_dir is not None:
        return hooks.state_dir
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect")


def stopped_by(exc: BaseException) -> str | None:
    """How ``exc`` stopped the run from outside, in words; None for a failure.

    Ctrl-C raises KeyboardInterrupt; a termination signal is raised as an exception outside ``Exception`` that
    carries the signal number (Prefect's ``TerminationSignal`` on SIGTERM, e.g. a cancellation)."""
    if isinstance(exc, KeyboardInterrupt):
        return "Ctrl-C"
    signum = getattr(exc, "signal", None)
    if not isinstance(exc, Exception) and isinstance(signum, int):
        return f"signal {signum}"
    return None


def controller_callbacks() -> tuple[Any, ...]:
    """The fit's extra controller callbacks handed in (``RunHooks.controller_callbacks``); none by default."""
    hooks = _HOOKS.get()
    return hooks.controller_callbacks if hooks is not None else ()


def ended_from_outside() -> bool:
    hooks = _HOOKS.get()
    return hooks.ended_from_outside if hooks is not None else False
