"""Finding the user's training code (``train_code``, ``package.module:attribute``) and running it on the workers.

Resolved the way ``uvicorn main:app`` and Prefect entrypoints are: the module is imported from the directory the
command runs in, or from the installed packages. A failure says which part failed (module, attribute, kind of
object) and where it was tried (this driver, or a worker of the cluster).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import os
import pkgutil
import sys
from pathlib import Path
from typing import Any

from raytrain_tasks.api import DATA_DIR_KEY, TRAIN_CONFIG_KEYS, Metric, TrainFunc, TrainSpec
from raytrain_tasks.errors import DataRefusedError, RunLeaseLostError, UserCodeError, user_frames


def resolve(train_code: str, where: str = "on this driver") -> TrainFunc:
    """The ``TrainFunc`` that ``train_code`` names; UserCodeError naming the part that failed otherwise."""
    module_name, _, attribute = train_code.partition(":")
    if not module_name or not attribute:
        raise UserCodeError(
            f"train_code {train_code!r} must be 'package.module:attribute' (e.g. 'my_project.train:training')"
        )
    _import_from_working_directory()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise UserCodeError(f"train_code {train_code!r}: {_not_found(exc.name, where)}") from exc
        raise UserCodeError(
            f"train_code {train_code!r}: importing {module_name!r} {where} failed: {user_frames(exc)}"
        ) from exc
    except Exception as exc:
        raise UserCodeError(
            f"train_code {train_code!r}: importing {module_name!r} {where} failed: {user_frames(exc)}"
        ) from exc
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UserCodeError(
                f"train_code {train_code!r}: module {module_name!r} has no attribute {attribute!r}"
                + _did_you_mean(part, _specs_in(target) or [name for name in dir(target) if not name.startswith("_")])
            )
        target = getattr(target, part)
    if isinstance(target, TrainSpec):
        from raytrain_tasks.trainspec.loop import as_train_func

        return as_train_func(target)
    if not isinstance(target, TrainFunc):
        hint = (
            " (a training function: wrap it as TrainFunc(train_func, metric=Metric(...), ...))"
            if callable(target)
            else ""
        )
        raise UserCodeError(
            f"train_code {train_code!r} is a {type(target).__name__}{hint}; it must name a "
            "raytrain_tasks.api.TrainFunc or TrainSpec"
        )
    return target


def bind(spec: TrainFunc, config: Any) -> TrainFunc:
    """``spec`` for the run of ``config`` (a TrainingConfig): its metric chosen, when the code's ``metric`` is a
    function of config (called with the config the code receives). UserCodeError when it returns no Metric, or a
    metric a TrainSpec's loop does not report."""
    if isinstance(spec.metric, Metric):
        return spec
    from raytrain_tasks.code_rules import spec_metric_problem
    from raytrain_tasks.trainspec.loop import SpecTrainFunc, as_train_func

    where = f"train_code {config.train_code!r}: its metric=... function"
    try:
        chosen = spec.metric(user_config(config, spec))
    except Exception as exc:  # the user's function: its own error, with its frames (test_code_settings)
        raise UserCodeError(f"{where} failed: {user_frames(exc)}") from exc
    if not isinstance(chosen, Metric):
        raise UserCodeError(f"{where} returned a {type(chosen).__name__}, not a raytrain_tasks.api.Metric")
    if isinstance(spec.train_func, SpecTrainFunc):
        if problem := spec_metric_problem(spec.train_func.spec, chosen):
            raise UserCodeError(f"{where} chose {chosen.name!r}: {problem}")
        return as_train_func(spec.train_func.spec, chosen)
    return dataclasses.replace(spec, metric=chosen)


def code_root(train_code: str) -> Path | None:
    """The folder to put on the workers' import path so that ``train_code`` imports there as here: the directory
    the top-level package or module was imported from; None for an installed package (in site-packages)."""
    top = importlib.import_module(train_code.partition(":")[0].split(".")[0])
    location = Path(getattr(top, "__file__", None) or next(iter(getattr(top, "__path__", [])), ""))
    root = location.parent.parent if location.name == "__init__.py" else location.parent
    return None if "site-packages" in root.parts else root.resolve()


def shipped_module(train_code: str) -> str | None:
    """What Ray's runtime_env ``py_modules`` ships to a cluster for ``train_code``: the folder of its top-level
    package (or its module file); None for an installed package, which the cluster's image must have, and for code
    of raytrain_tasks itself (the table classifier), which the pipeline ships as its own."""
    top_name = train_code.partition(":")[0].split(".")[0]
    if top_name == __name__.split(".")[0] or code_root(train_code) is None:
        return None
    top = importlib.import_module(top_name)
    paths = list(getattr(top, "__path__", []))
    return str(Path(paths[0]).resolve()) if paths else str(Path(str(top.__file__)).resolve())


def user_config(config: Any, spec: TrainFunc, data_dir: Path | None = None) -> dict[str, Any]:
    """The ``config`` the user's code receives: the pipeline's own settings (``TRAIN_CONFIG_KEYS``), the code's
    own (its defaults or settings class, with ``train_config`` over them: ``code_settings.code_values``), and
    ``DATA_DIR_KEY``: ``data_dir``, the local folder of the run's prepared data, for code with ``prepare`` (None
    while it runs)."""
    from raytrain_tasks.code_settings import code_values

    own = {
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "lr": config.learning_rate,
        "seed": config.seed,
        "num_workers": config.num_workers,
        "use_gpu": config.use_gpu,
    }
    assert tuple(own) == TRAIN_CONFIG_KEYS
    merged = {**own, **copy.deepcopy(code_values(spec, config.train_config, config.train_code))}  # code may change it
    if spec.prepare is not None:
        merged[DATA_DIR_KEY] = None if data_dir is None else str(data_dir)
    return merged


def run_train_func(loop_config: dict[str, Any]) -> None:
    """What each Ray Train worker runs for user code: the user's ``train_func`` with its config."""
    from raytrain_tasks.checked_reports import checked_reports
    from raytrain_tasks.trainspec.loop import SpecTrainFunc

    _on_import_path(loop_config.get("code_dir", ""))
    spec = resolve(loop_config["train_code"], where="on a Ray Train worker")
    _only_the_verified_checkpoint(loop_config.get("start"), frozenset(loop_config.get("present", ())))
    config = dict(loop_config["config"])
    if loop_config.get("data") is not None:
        from raytrain_tasks.prepared import PreparedData, local_data_dir
        from raytrain_tasks.storage.filesystem import StorageOptions

        data = PreparedData.model_validate(loop_config["data"])
        config[DATA_DIR_KEY] = str(local_data_dir(data, StorageOptions.model_validate(loop_config["storage"])))
    if loop_config.get("ray_splits") is not None:  # a TrainSpec's Ray Dataset splits, as the driver found them
        if not isinstance(spec.train_func, SpecTrainFunc):
            raise UserCodeError(
                f"train_code {loop_config['train_code']!r} is a TrainSpec of Ray Datasets where the flow runs, "
                "not on this Ray Train worker: the code differs between the two (ship the same code to both)"
            )
        spec.train_func.ray_splits = loop_config["ray_splits"]
    if loop_config.get("step_checkpoints") and isinstance(spec.train_func, SpecTrainFunc):
        from raytrain_tasks.long_runs import StepCheckpoints

        spec.train_func.step_checkpoints = StepCheckpoints(**loop_config["step_checkpoints"])
    if isinstance(spec.train_func, SpecTrainFunc):
        spec.train_func.driver_stop = loop_config.get("driver_stop")
    try:
        names_checkpoints, lease = isinstance(spec.train_func, SpecTrainFunc), loop_config.get("lease")
        storage, higher = loop_config.get("storage"), bool(loop_config.get("higher_is_better", True))
        with checked_reports(loop_config.get("metric"), names_checkpoints, lease, storage, higher):
            spec.train_func(config)
    except (TypeError, ImportError) as exc:
        # Ray Train hands the controller the exception alone (its traceback stays in the worker's log): the
        # user's own frames go into the message, and code_error_stopper ends the fit on it.
        raise UserCodeError(user_frames(exc)) from exc


def _only_the_verified_checkpoint(start: str | None, present: frozenset[str]) -> None:
    """What ``ray.train.get_checkpoint()`` hands the user's code: of the folders in the run's storage as the fit
    started (``present``), only ``start``, the newest whose files the driver verified against the digest recorded
    when it was committed (None: the first epoch). Never a rejected checkpoint (a rank's shard missing, a file
    changed), nor a folder Ray Train's record was pointed at (it has no recorded digest); a checkpoint this fit
    committed (a restarted worker group's) is handed over as Ray Train chose it.

    Ray Train 2.60 resumes from the newest checkpoint its record lists, verified or not; the worker's
    ``TrainContext.checkpoint`` (ray/train/v2/_internal/execution/context.py) is what ``get_checkpoint()``
    returns, and the one private attribute this sets. tests/examples/test_own_code.py fails if its shape changes.
    """
    if not present:  # a new run: every checkpoint is this fit's (and local mode has no TrainContext to read)
        return
    import ray.train
    from ray.train.v2._internal.execution.context import get_train_context

    context = get_train_context()
    current = context.checkpoint
    if current is None:
        return
    name = current.path.rstrip("/").rsplit("/", 1)[-1]
    if name == start or name not in present:
        return
    parent = current.path.rstrip("/").rsplit("/", 1)[0]
    context.checkpoint = (
        None if start is None else ray.train.Checkpoint(f"{parent}/{start}", filesystem=current.filesystem)
    )


def check_importable(train_code: str, code_dir: str) -> str:
    """Run as a Ray task on the target cluster before any training worker starts: "" when ``train_code``
    resolves there, the reason otherwise."""
    try:
        _on_import_path(code_dir)
        resolve(train_code, where="on a Ray worker of the cluster")
    except UserCodeError as exc:
        return str(exc)
    return ""


def _on_import_path(code_dir: str) -> None:
    """The driver's folder of the user's code, where a worker on the same machine (or a shared mount) sees it;
    on a cluster, Ray's runtime_env (``py_modules``) puts the code on the path instead."""
    if code_dir and os.path.isdir(code_dir) and code_dir not in sys.path:
        sys.path.insert(0, code_dir)


def _import_from_working_directory() -> None:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _specs_in(target: Any) -> list[str]:
    return [name for name, value in vars(target).items() if isinstance(value, TrainFunc | TrainSpec)]


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=3)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def _not_found(missing: str, where: str) -> str:
    """Why ``missing`` (a dotted module name) cannot be imported: its top package is not on the path (run from
    elsewhere, or install it), or a part below a package that is there is misspelt (the package's modules named)."""
    parent, _, leaf = missing.rpartition(".")
    if parent:
        found = importlib.import_module(parent)  # imported already: the import failed below it
        if not hasattr(found, "__path__"):
            return f"{parent!r} ({found.__file__}) is a module, not a package: it has no module {leaf!r}"
        folders = [str(path) for path in found.__path__]
        modules = sorted(info.name for info in pkgutil.iter_modules(folders))
        return (
            f"package {parent!r} ({', '.join(folders)}) has no module {leaf!r} {where}"
            + _did_you_mean(leaf, modules)
            + f"; it has: {', '.join(modules) or 'no modules'}"
        )
    here = [info.name for info in pkgutil.iter_modules([os.getcwd()])]
    return (
        f"no module named {missing!r} {where}{_did_you_mean(missing, here)} (searched the directory the command "
        f"runs in, {os.getcwd()}, and the installed packages); run from the folder that holds {missing!r} or "
        "install it"
    )


def code_error_stopper(train_code: str, metric: str) -> Any:
    """A Ray Train callback (it runs on the controller) that fails the fit at once when the user's code raised a
    TypeError or ImportError (or could not be resolved on a worker), or a worker refused the data
    (DataRefusedError: changed since the run's last checkpoint, an empty split), or a checkpoint came with a report
    without ``metric``: such an error repeats on every attempt, so the worker-group restarts (``max_failures``) and
    Prefect's retries would only repeat it. Other exceptions (a failed read included) are retried from the last
    checkpoint as before."""
    from ray.train import UserCallback

    from raytrain_tasks.checked_reports import missing_metric

    class StopOnCodeErrors(UserCallback):  # type: ignore[misc]
        def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
            # Ray Train attaches rank 0's metrics to a checkpoint any rank passed: the workers check only where
            # rank 0 passed it. Here Ray Train's checkpoint manager has already registered it, and may have
            # removed an older checkpoint for it; this stops the fit before it is logged or pinned.
            if checkpoint is not None and metrics and (problem := missing_metric(metrics[0], metric)):
                raise UserCodeError(f"train_code {train_code!r}: {problem}\nNot retried: every attempt reports alike")

        def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
            for rank, error in sorted(worker_exceptions.items()):
                base = getattr(error, "_base_exc", error)  # Ray Train's UserExceptionWithTraceback
                if isinstance(base, RunLeaseLostError):  # another driver holds the run now: never retried here
                    raise RunLeaseLostError(f"worker rank {rank}: {base}")
                if isinstance(base, DataRefusedError):  # data changed since the checkpoint, an empty split
                    raise DataRefusedError(
                        f"train_code {train_code!r} on worker rank {rank}: {str(base)[-4000:]}\nNot retried: the "
                        "same data is refused on every attempt"
                    )
                if isinstance(base, TypeError | ImportError | UserCodeError):
                    raise UserCodeError(
                        f"train_code {train_code!r} failed on worker rank {rank}: {str(base)[-4000:]}\nNot retried: "
                        "an error of the code itself fails the same way on every attempt. A fault in the code: fix "
                        "it, then continue the run with `resume`. A value of train_config the code cannot use: "
                        "start a new run with a corrected train_config (a resume keeps the run's settings)"
                    )

    return StopOnCodeErrors()
