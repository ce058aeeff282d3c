"""What a report of the user's code may hold, checked on the Ray Train worker as it reports, before Ray Train
takes it: a checkpoint comes with the run's metric, and the pipeline names the checkpoint's folder."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from raytrain_tasks.errors import RunLeaseLostError, UserCodeError
from raytrain_tasks.tracking.names import RANK_SCORE_KEY


def missing_metric(metrics: Any, metric: str) -> str | None:
    """Why a checkpoint whose report is ``metrics`` cannot be scored by ``metric``; None when it can. Only an int or
    a float is one (what MLflow logs and the best checkpoint is chosen by); a NaN is, and is ranked last."""
    value = metrics.get(metric) if isinstance(metrics, dict) else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return None
    held = sorted(map(str, metrics)) if isinstance(metrics, dict) else type(metrics).__name__
    return (
        f"train_func reported a checkpoint without {metric!r} as a number (its report holds {held}). Ray Train "
        "keeps a run's checkpoints by that metric, and would keep one without it before those with it when lower "
        f"is better; the best is registered. Report {metric!r} with every checkpoint (or name a metric it reports "
        "in TrainFunc(metric=...)), then continue the run with `resume`"
    )


# Worse than any finite score: what a checkpoint without a finite figure of the metric ranks by (Ray Train would
# write a NaN to its record as null, which it cannot read back on a resume).
UNSCORED = -1e308


def ranking_score(value: Any, higher_is_better: bool) -> float:
    """What Ray Train keeps a run's checkpoints by (``RANK_SCORE_KEY``, higher is better): the metric, negated
    when lower is better; ``UNSCORED`` for a report without a finite one (a checkpoint within an epoch, a diverged
    epoch), so that it ranks last."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return UNSCORED
    return float(value) if higher_is_better else -float(value)


def named_folder(checkpoint_dir_name: Any) -> str:
    return (
        f"train_func passed checkpoint_dir_name={checkpoint_dir_name!r} to ray.train.report: leave that argument "
        "out. The pipeline names a run's checkpoints itself (Ray Train's checkpoint_<timestamp>): by those names "
        "it verifies them and resumes from them after a kill. Nothing was saved under this name; remove the "
        "argument, then continue the run with `resume`"
    )


def lease_taken(lease: dict[str, str] | None, storage: dict[str, Any] | None) -> str | None:
    """Why this fit's driver no longer holds the run's lease (``lease``: its object's URI and the driver's holder
    name; None for a fit without one); None while it does, or when storage cannot be read now (the checkpoint's
    own upload then fails, or the driver's renewals notice)."""
    import json

    from raytrain_tasks.storage.filesystem import StorageOptions
    from raytrain_tasks.storage.locations import locate

    if not lease:
        return None
    try:
        found = locate(lease["uri"], StorageOptions.model_validate(storage or {})).read_aged(2)
    except OSError:
        return None
    try:
        holder = str(json.loads(found.text)["holder"]) if found is not None else None
    except (ValueError, KeyError, TypeError):
        holder = "someone (the lease object is not one this project wrote)"
    if holder == lease["holder"]:
        return None
    return (
        f"the run's lease ({lease['uri']}) is {'gone' if holder is None else f'held by {holder}'}, not by this fit's "
        f"driver {lease['holder']} (frozen past its lease: a paused VM, Ctrl-Z, a hung storage call). Its workers "
        "stop before committing a checkpoint, which would race with those of the run's new driver"
    )


@contextlib.contextmanager
def checked_reports(
    metric: str | None,
    names_checkpoints: bool,
    lease: dict[str, str] | None = None,
    storage: dict[str, Any] | None = None,
    higher_is_better: bool = True,
) -> Iterator[None]:
    """Within it, each ``ray.train.report`` of this worker raises UserCodeError, before Ray Train takes the report,
    when it passes ``checkpoint_dir_name`` (unless ``names_checkpoints``: a TrainSpec's loop, which names them for
    their epoch), or on rank 0 a checkpoint without ``metric`` (Ray Train attaches rank 0's metrics to it; the
    controller's code_error_stopper checks the others). On every rank, a checkpoint is refused with
    RunLeaseLostError once ``lease`` is no longer this fit's driver's (``lease_taken``): only the driver renews and
    watches the lease, and a frozen one cannot stop its Ray Train controller and workers.

    ``ray.train.report`` calls the worker's ``TrainFnUtils.report`` (ray/train/v2/_internal/execution/
    train_fn_utils.py), in local mode too, however the code imported it: this shadows it on that object.
    tests/examples/test_own_code_reports.py fails if its shape changes.
    """
    from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils

    utils = get_train_fn_utils()
    rank = utils.get_context().get_world_rank()
    report = utils.report

    def checked(metrics: Any, checkpoint: Any = None, checkpoint_dir_name: Any = None, *args: Any, **kw: Any) -> Any:
        if checkpoint_dir_name is not None and not names_checkpoints:
            raise UserCodeError(named_folder(checkpoint_dir_name))
        if checkpoint is not None and rank == 0 and metric is not None and (problem := missing_metric(metrics, metric)):
            raise UserCodeError(problem)
        if checkpoint is not None and (taken := lease_taken(lease, storage)):
            raise RunLeaseLostError(taken)
        # On every report, checkpoint or not: Ray Train keeps rank 0's metrics with whichever rank's checkpoint.
        if metric is not None and isinstance(metrics, dict):
            metrics = {**metrics, RANK_SCORE_KEY: ranking_score(metrics.get(metric), higher_is_better)}
        return report(metrics, checkpoint, checkpoint_dir_name, *args, **kw)

    setattr(utils, "report", checked)  # noqa: B010 - mypy refuses assigning to a method
    try:
        yield
    finally:
        delattr(utils, "report")  # the class's own again
