"""What a report of the user's code may hold, checked on the Ray Train worker as it reports, before Ray Train
takes it: a checkpoint comes with the run's metric, and the pipeline names the checkpoint's folder."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from raytrain_tasks.errors import UserCodeError


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


def named_folder(checkpoint_dir_name: Any) -> str:
    return (
        f"train_func passed checkpoint_dir_name={checkpoint_dir_name!r} to ray.train.report: leave that argument "
        "out. The pipeline names a run's checkpoints itself (Ray Train's checkpoint_<timestamp>): by those names "
        "it verifies them and resumes from them after a kill. Nothing was saved under this name; remove the "
        "argument, then continue the run with `resume`"
    )


@contextlib.contextmanager
def checked_reports(metric: str | None, names_checkpoints: bool) -> Iterator[None]:
    """Within it, each ``ray.train.report`` of this worker raises UserCodeError, before Ray Train takes the report,
    when it passes ``checkpoint_dir_name`` (unless ``names_checkpoints``: a TrainSpec's loop, which names them for
    their epoch), or on rank 0 a checkpoint without ``metric`` (Ray Train attaches rank 0's metrics to it; the
    controller's code_error_stopper checks the others).

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
        return report(metrics, checkpoint, checkpoint_dir_name, *args, **kw)

    setattr(utils, "report", checked)  # noqa: B010 - mypy refuses assigning to a method
    try:
        yield
    finally:
        delattr(utils, "report")  # the class's own again
