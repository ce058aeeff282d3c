"""The fit's pre-flight, once for both launch modes: what must hold before an MLflow run or a checkpoint is
created, and before any Ray Train worker is requested. Cheapest first; each failure names the setting to change."""

from __future__ import annotations

import re
import sys
from typing import Any

from raytrain_driver.cluster import ray_of_this_machine
from raytrain_driver.hooks import run_logger
from raytrain_driver.sizing import (
    USER_DATASET_CPUS,
    FitPlan,
    alive_node_resources,
    check_resources,
    check_storage_on_nodes,
    read_mounts,
    sized_for_cluster,
    storage_shared_with_nodes,
)
from raytrain_tasks.api import TrainFunc
from raytrain_tasks.code_rules import data_dir_refused
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import (
    CheckpointError,
    DatasetError,
    SettingsError,
    TrackingError,
    UserCodeError,
    user_frames,
)
from raytrain_tasks.long_runs import RecordedEpoch, recorded_epochs, step_time_refusal
from raytrain_tasks.prepared import RunData
from raytrain_tasks.redact import redact_uri
from raytrain_tasks.settings import MODEL_NAME_MAX, MODEL_NAME_PATTERN
from raytrain_tasks.storage.locations import StorageLocation
from raytrain_tasks.tracking import runs as tracking
from raytrain_tasks.tracking.names import STEP_SERIES
from raytrain_tasks.user_code import resolve

# What of a run's config its code sees (user_config) or is checked against: its resolution depends on these alone.
_CODE_SEES = {
    "train_code",
    "train_config",
    "epochs",
    "batch_size",
    "learning_rate",
    "seed",
    "num_workers",
    "use_gpu",
    "register",
}
# Settings the code sees -> (the object train_code named then, the TrainFunc made of it).
_RESOLVED: dict[str, tuple[object, TrainFunc]] = {}


def _named_object(train_code: str) -> object | None:
    """What ``train_code`` names as imported now (a test may import or replace it anew); None before its import."""
    module_name, _, attribute = train_code.partition(":")
    target: object | None = sys.modules.get(module_name)
    for part in attribute.split("."):
        target = getattr(target, part, None)
    return target


def resolve_code(config: TrainingConfig) -> TrainFunc:
    """The user's code (``train_code``), imported here before anything starts, its settings checked and bound.

    Once per process for the settings the code sees: the CLI's check, prepare-data, the fit and register-model
    share one TrainFunc, and the code's ``metric`` function is called once."""
    key = config.model_dump_json(include=_CODE_SEES)
    named = _named_object(config.train_code)
    if named is not None and (found := _RESOLVED.get(key)) is not None and found[0] is named:
        return found[1]
    spec = _resolve_and_check(config)
    _RESOLVED[key] = (_named_object(config.train_code), spec)  # held: what it names is compared by identity
    return spec


def _resolve_and_check(config: TrainingConfig) -> TrainFunc:
    from raytrain_tasks.code_settings import code_values
    from raytrain_tasks.user_code import bind

    spec = resolve(config.train_code)
    if spec.prepare is not None and (refused := data_dir_refused(config.train_config, "train_config")):
        raise UserCodeError(f"train_code {config.train_code!r}: {refused}")
    code_values(spec, config.train_config, config.train_code)  # train_config fits the code's settings
    spec = bind(spec, config)  # its metric, when a setting chooses it
    if config.register and not spec.can_register:
        raise UserCodeError(
            f"train_code {config.train_code!r} gives no load_model/input_example, so nothing it trains can be "
            "registered: add them to its TrainFunc, or set `register` off (--no-register)"
        )
    return spec


def code_model_name(config: TrainingConfig) -> str:
    """The registered model's name the user's code gives (``model_name(config)`` of its TrainFunc or TrainSpec)
    where the run leaves the ``model_name`` setting at its default; "" otherwise (``TrainingConfig.resolved`` then
    names it). UserCodeError naming train_code when the function fails or gives no usable name."""
    default = TrainingConfig.model_fields["model_name"].default
    if config.model_name != default:
        return ""
    spec = resolve_code(config)
    if spec.model_name is None:
        return ""
    from raytrain_tasks.user_code import user_config

    where = f"train_code {config.train_code!r}: its model_name(config)"
    try:
        name = spec.model_name(user_config(config, spec))
    except Exception as exc:  # the user's function: its own error, with its frames (test_code_settings)
        raise UserCodeError(f"{where} failed: {user_frames(exc)}") from exc
    if not isinstance(name, str) or not re.fullmatch(MODEL_NAME_PATTERN, name) or len(name) > MODEL_NAME_MAX:
        raise UserCodeError(
            f"{where} returned {name!r}: a registered model's name is 1-{MODEL_NAME_MAX} letters, digits, spaces, "
            "'.', '_' or '-', starting with a letter or digit (or set `model_name` for the run)"
        )
    return name


def check_spec_data(config: TrainingConfig, spec: TrainFunc, dataset: RunData | None) -> bool:
    """Whether the user's code trains on Ray Datasets (its ``datasets=``, or a TrainSpec's Ray Dataset splits).
    A ``TrainSpec``'s ``data(config)`` runs once, here, with Ray connected (it may build Ray Datasets): Splits of
    the wrong kind, an empty split, no test split or a missing column fail the fit in seconds, before an MLflow run
    or any worker (every worker would refuse them too)."""
    from raytrain_tasks.prepared import data_dir_of
    from raytrain_tasks.trainspec.loop import SpecTrainFunc
    from raytrain_tasks.user_code import user_config

    if not isinstance(spec.train_func, SpecTrainFunc):
        return spec.datasets is not None
    code_config = user_config(config, spec, data_dir_of(dataset, config.storage_options))
    ray_data = spec.train_func.check_data(code_config)
    rows, workers = spec.train_func.train_rows, config.worker_range[1]
    if rows is not None and rows < workers:  # each worker trains on a share: one would get none (or repeats)
        raise DatasetError(
            f"the train split of train_code {config.train_code!r} has {rows} rows, fewer than the {workers} "
            "workers that would each train on a share of it; lower `num_workers` (and `max_workers`) or give it "
            "more rows"
        )
    return ray_data


def check_long_run_settings(config: TrainingConfig, spec: TrainFunc, ray_data: bool) -> None:
    """SettingsError, before any worker starts, for checkpoints within epochs that the run's code or data cannot
    resume from exactly (raytrain_tasks.long_runs)."""
    from raytrain_tasks.long_runs import StepCheckpoints, step_checkpoint_refusal
    from raytrain_tasks.trainspec.loop import SpecTrainFunc

    checkpoints = StepCheckpoints(config.checkpoint_every_steps, config.checkpoint_every_minutes)
    why = step_checkpoint_refusal(checkpoints, isinstance(spec.train_func, SpecTrainFunc), ray_data)
    if why:
        raise SettingsError(f"train_code {config.train_code!r}: {why}")


def check_step_time(config: TrainingConfig, client: Any, experiment_id: str, run_key: str) -> None:
    """SettingsError, before any worker starts, when the MLflow run this fit continues (a resume, a retry) took
    steps too long for `hang_timeout_s` (raytrain_tasks.long_runs.step_time_refusal). A new run has none."""
    run = tracking.find_run(client, experiment_id, run_key)
    if run is None:
        return
    run_id = run.info.run_id
    measured = f"MLflow run {run_id} (run key {run_key})"
    if why := step_time_refusal(config.hang_timeout_s, config.use_gpu, _recorded_epochs(client, run_id), measured):
        raise SettingsError(why)


def _recorded_epochs(client: Any, run_id: str) -> list[RecordedEpoch]:
    """The run's epochs, as their reports logged them: ``epoch_seconds`` at the epoch's number, and the global step
    at its end as the step of its ``steps/train_loss`` point."""
    # An epoch's report is one batch with one timestamp (tracking.controller.log_epoch): its seconds and its point
    # share it. A checkpoint within an epoch logs a point of its own; where two share a timestamp, neither counts.
    ends: dict[int, list[int]] = {}
    for point in client.get_metric_history(run_id, STEP_SERIES):
        ends.setdefault(point.timestamp, []).append(int(point.step))
    logged: list[tuple[int, float, int | None]] = []
    for seconds in sorted(client.get_metric_history(run_id, "epoch_seconds"), key=lambda m: (m.timestamp, m.step)):
        at = ends.get(seconds.timestamp, [])
        logged.append((int(seconds.step), seconds.value, at[0] if len(at) == 1 else None))
    return recorded_epochs(logged)


def data_tasks_during_fit(spec: TrainFunc) -> bool:
    """Whether the user's Ray Datasets (found by ``check_spec_data``) run read and transform tasks while the
    workers train, which need a CPU the workers leave free: a TrainFunc's ``datasets=`` (built later, as they
    may stream), a TrainSpec's splits unless all are kept in the object store (materialized, as the table
    classifier keeps what fits)."""
    from raytrain_tasks.trainspec.loop import SpecTrainFunc

    if isinstance(spec.train_func, SpecTrainFunc):
        return spec.train_func.ray_data and not spec.train_func.kept
    return spec.datasets is not None


def shown_params(config: TrainingConfig, spec: TrainFunc) -> dict[str, Any]:
    """The run's MLflow params: its settings, and what the user's code gets of its own (``train_config.<key>``),
    the code's secrets masked."""
    from raytrain_tasks.code_settings import secret_keys, shown_values

    values = shown_values(spec, config.train_config, config.train_code)
    return config.public_params(values, secret_keys=secret_keys(spec.settings))


def code_secret_keys(config: TrainingConfig) -> frozenset[str]:
    """The ``train_config`` keys the run's code declares secret; every key when the code cannot be loaded (which
    are secrets cannot be told then)."""
    from raytrain_tasks.code_settings import secret_keys

    try:
        return secret_keys(resolve(config.train_code).settings)
    except (UserCodeError, TypeError):
        return frozenset(config.train_config)


def check_resume(config: TrainingConfig, run_key: str, run_dir: StorageLocation) -> None:
    """A resume continues ``run_key``'s MLflow run in the store and experiment this run logs to. Checked before
    anything is created: an MLflow run, an experiment, a local store, the lease.

    Storage holds what the run's fit wrote but that experiment has no run of it: TrackingError naming where it
    looked. No MLflow run and no folder in storage: CheckpointError. A run with no committed checkpoint yet trains
    from its first epoch, in its MLflow run: it stopped before its first epoch was committed (the likeliest moment
    to run out of memory: loading data, the first epoch)."""
    from raytrain_driver.fit_steps import RAY_CHECKPOINT_RECORD

    client = tracking.existing_store(config.mlflow_tracking_uri, config.s3_endpoint_url)
    experiment = client.get_experiment_by_name(config.experiment_name) if client is not None else None
    run = (
        tracking.find_run(client, experiment.experiment_id, run_key)
        if client is not None and experiment is not None
        else None
    )
    where = f"experiment {config.experiment_name!r} of MLflow at {redact_uri(config.mlflow_tracking_uri)}"
    written = _written_by_fit(run_dir)
    if run is None and written:
        # A fit writes these only after it opened its MLflow run: the run is in another store or experiment (or
        # deleted). Opening one here would resume no checkpoint (MLflow vouches for none) and leave a stray run.
        others = tracking.experiments_with_run(client, run_key) if client is not None else []
        shown = ", ".join(written[:3]) + (", ..." if len(written) > 3 else "")
        raise TrackingError(
            f"cannot resume run {run_key}: {run_dir.uri} holds what its fit wrote ({shown}), but {where} has no "
            f"MLflow run tagged {tracking.RUN_KEY_TAG}={run_key}"
            + (f" (this store has one in experiment {', '.join(map(repr, others))})" if others else "")
            + ". Nothing was created. Set `mlflow_tracking_uri` and `experiment_name` to the store and experiment "
            "the run started in; a deleted MLflow run must be restored first"
        )
    if run is None and not run_dir.exists():
        raise CheckpointError(
            f"cannot resume run {run_key}: no MLflow run of it in {where} and nothing under {run_dir.uri}; check "
            "`resume`, `mlflow_tracking_uri`, `experiment_name` and `storage_path` (they must match the "
            "interrupted run)"
        )
    if RAY_CHECKPOINT_RECORD not in written:
        run_logger().warning(
            "run %s has no committed checkpoint yet (it stopped before its first epoch ended): training from epoch 1%s",
            run_key,
            f" in MLflow run {run.info.run_id}" if run is not None else "",
        )


def _written_by_fit(run_dir: StorageLocation) -> list[str]:
    """What of the run's folder only a fit writes, once its MLflow run is open: Ray Train's record of the
    checkpoints, checkpoint folders, the fit record (not the lease, taken before)."""
    from raytrain_driver.fit_record import FIT_RECORD
    from raytrain_driver.fit_steps import RAY_CHECKPOINT_RECORD, is_checkpoint_folder

    return [n for n in run_dir.list_names() if n in (RAY_CHECKPOINT_RECORD, FIT_RECORD) or is_checkpoint_folder(n)]


def workers_code_dir(config: TrainingConfig) -> str:
    """Where a local Ray's workers find the user's code: the folder it was imported from here. On a cluster
    (``ray_address``) the workers get it through Ray's runtime_env instead
    (``raytrain_driver.cluster.cluster_runtime_env``)."""
    from raytrain_tasks.user_code import code_root

    return "" if config.ray_address else str(code_root(config.train_code) or "")


def check_cluster(
    config: TrainingConfig, runs: StorageLocation, client: Any, run_key: str, user_datasets: bool = False
) -> FitPlan:
    """With Ray connected: the cluster can host the workers and every node can write the run's storage. Returns
    the worker group's plan (``cpus_per_worker`` sized to the cluster when unset; an earlier attempt's share of
    the run, read from its MLflow run through ``client``, while it still fits), what the trainer is built from.
    ``user_datasets``: the user's code gives Ray Datasets, whose read and transform tasks need a CPU the workers
    leave free."""
    import ray

    available = ray.cluster_resources()
    streamed = user_datasets
    nodes = alive_node_resources()
    earlier = None if config.cpus_per_worker else tracking.earlier_share(client, config.experiment_name, run_key)
    data_cpus = USER_DATASET_CPUS
    plan = sized_for_cluster(config, nodes, streamed, earlier, data_cpus)
    check_resources(config, plan, available, streamed, user_datasets, data_cpus)
    storage_shared_with_nodes(config.storage_path, len(nodes), read_mounts())
    if config.ray_address:  # a local Ray's node is this process's machine, with this process's credentials
        check_storage_on_nodes(runs.uri, config.storage_options)
    if not ray_of_this_machine():
        # A cluster's nodes may lack a package this machine has. The workers of a Ray this process started here
        # (or serve's warm Ray) run this interpreter on this machine with the folder the code was imported from
        # (workers_code_dir): the driver's import in resolve_code is theirs, and a task would only start one more
        # process (~2.7 s here). A Ray the caller connected by itself may be anywhere: checked like a cluster.
        from raytrain_driver.fit_steps import check_importable_on_cluster

        check_importable_on_cluster(config.train_code, workers_code_dir(config))
    if plan.sized:
        run_logger().info(
            "cpus_per_worker unset: %s workers x %g CPUs each, %s the cluster's %g CPUs%s",
            "-".join(map(str, sorted(set(config.worker_range)))),
            plan.cpus_per_worker,
            "as the run's earlier attempt trained, on" if plan.cpus_per_worker == earlier else "sized to",
            available.get("CPU", 0.0),
            f" ({data_cpus:g} left to Ray Data's streaming tasks)" if streamed else "",
        )
    return plan
