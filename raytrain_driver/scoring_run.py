"""The scoring run itself, once ``raytrain_driver.scoring.plan_scoring`` has refused what it could: Ray Data reads
the input, ``concurrency`` actors predict (raytrain_tasks.scoring.predictor), the parts are staged beside the output
and committed as one file, and an MLflow run records which version scored which input, and how many rows."""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from raytrain_driver.cluster import ray_session
from raytrain_driver.hooks import stopped_by
from raytrain_driver.scoring import ScoringPlan
from raytrain_driver.scoring_input import check_unchanged, csv_options
from raytrain_driver.scoring_output import (
    OutputAction,
    Provenance,
    clear_attempts,
    commit,
    read_provenance,
    staging_location,
)
from raytrain_tasks.errors import ClusterError, ScoringInputError
from raytrain_tasks.redact import redact_uri
from raytrain_tasks.scoring.config import ScoringConfig
from raytrain_tasks.storage.locations import StorageLocation, locate
from raytrain_tasks.tracking import runs as tracking

logger = logging.getLogger(__name__)

MODEL_TAG, VERSION_TAG = "prefect_raytrain.scoring.model", "prefect_raytrain.scoring.version"
INPUT_HASH_TAG = "prefect_raytrain.scoring.input_sha256"
# The actors leave this much CPU of a small cluster to Ray Data's read and write tasks, which would wait for a free
# CPU forever if the actors held them all.
CPUS_FOR_IO = 1.0


class ScoringResult(BaseModel):
    """What a scoring run wrote, or found already written."""

    model_config = ConfigDict(frozen=True)

    model: str
    version: str
    rows: int
    output_path: str
    input_sha256: str
    mlflow_run_id: str
    already_written: bool = False
    seconds: float = 0.0


def score(config: ScoringConfig, plan: ScoringPlan) -> ScoringResult:
    """Carry out ``plan``: predictions of every input row, committed as one file, recorded in MLflow."""
    output = locate(config.output_path, config.storage_options)
    if plan.action is OutputAction.ALREADY_WRITTEN:
        found = read_provenance(output)
        held = found if isinstance(found, Provenance) else plan.provenance
        logger.info("output_path %s: %s; nothing to score", redact_uri(config.output_path), plan.why)
        return _result(config, plan, held.rows, held.mlflow_run_id, already_written=True)
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    run_id = _open_record(client, config, plan)
    started, work = time.perf_counter(), _work(plan, config)
    staging = staging_location(output, work, secrets.token_hex(4))  # this attempt's own: another's never mixes in
    try:
        with ray_session(config):
            _check_cluster(config)
            _predict(config, plan, _checked_files(plan), staging)
        check_unchanged(config, plan.table)  # the output must hold the rows of the input it records
        rows = commit(staging, output, Provenance(**{**plan.provenance.__dict__, "mlflow_run_id": run_id}))
    except BaseException as exc:
        if (why := stopped_by(exc)) is not None:
            tracking.stop_run(client, run_id, f"stopped by {why}: nothing was written", exc)
        else:
            tracking.fail_run(client, run_id, exc)
        raise
    try:  # what crashed attempts of the same work left; the output is written whatever this does
        clear_attempts(output, work, time.time())
    except OSError as exc:
        logger.warning("could not remove old staging folders beside %s: %s", redact_uri(config.output_path), exc)
    seconds = time.perf_counter() - started
    _close_record(client, run_id, rows, seconds)
    logger.info(
        "scored %d rows with %s version %s in %.1f s: %s",
        rows,
        plan.model.name,
        plan.model.version,
        seconds,
        redact_uri(config.output_path),
    )
    return _result(config, plan, rows, run_id, seconds=seconds)


def _result(config: ScoringConfig, plan: ScoringPlan, rows: int, run_id: str, **more: Any) -> ScoringResult:
    return ScoringResult(
        model=plan.model.name,
        version=plan.model.version,
        rows=rows,
        output_path=config.output_path,
        input_sha256=plan.table.sha256,
        mlflow_run_id=run_id,
        **more,
    )


def _work(plan: ScoringPlan, config: ScoringConfig) -> str:
    """The same for a rerun of the same work (its staging folders are cleared once it commits), another for other
    work."""
    work = f"{plan.model.name}\n{plan.model.version}\n{plan.table.sha256}\n{config.output_path}"
    return hashlib.sha256(work.encode()).hexdigest()[:16]


def _check_cluster(config: ScoringConfig) -> None:
    """GPUs where use_gpu asks for them; on several nodes, local paths that every node shares (Ray Data's tasks
    read and write on any node)."""
    import ray

    from raytrain_driver.sizing import read_mounts, storage_shared_with_nodes

    if config.use_gpu and ray.cluster_resources().get("GPU", 0) < 1:
        raise ClusterError("use_gpu is on, and the Ray cluster has no GPU: turn use_gpu off, or set ray_address")
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    for setting in ("input_path", "output_path"):
        storage_shared_with_nodes(getattr(config, setting), nodes, read_mounts(), setting)


def _checked_files(plan: ScoringPlan) -> dict[str, bytes]:
    """The model's files as they were checked when the run was planned; refused if any changed since."""
    folder = Path(plan.model.folder)
    files = {name: (folder / name).read_bytes() for name in plan.model.files_sha256}
    changed = [
        name for name, data in files.items() if hashlib.sha256(data).hexdigest() != plan.model.files_sha256[name]
    ]
    if changed:
        raise ScoringInputError(f"the model's checked copy changed before scoring ({', '.join(changed)}): run again")
    return files


def _predict(config: ScoringConfig, plan: ScoringPlan, files: dict[str, bytes], staging: StorageLocation) -> None:
    """Ray Data: read, predict in an actor pool, write the parts under ``staging``."""
    import ray

    from raytrain_tasks.scoring.predictor import Predictor
    from raytrain_tasks.trainspec.data import quiet_ray_data

    quiet_ray_data()  # the command's console shows the run's own lines, not Ray Data's progress
    source = locate(config.input_path, config.storage_options)
    if plan.table.format == "parquet":
        dataset = ray.data.read_parquet(list(plan.table.files), filesystem=source.filesystem)
    else:  # its key column as text, as the plan read it
        options = csv_options(plan.features.key)
        dataset = ray.data.read_csv(list(plan.table.files), filesystem=source.filesystem, convert_options=options)
    dataset = dataset.select_columns(list(dict.fromkeys([plan.features.key, *plan.features.features])))
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    per_actor = 0.0 if config.use_gpu else min(1.0, max(cpus - CPUS_FOR_IO, 0.1) / config.concurrency)
    predicted = dataset.map_batches(
        Predictor,
        fn_constructor_kwargs={
            # Ray Data puts them in the object store with the rest of the pool's recipe and holds them until the
            # run ends: an actor that dies restarts with them (Ray's warning of it, ray#53727, is for other cases).
            "files": files,
            "plan": plan.features,
            "dtype": plan.model.inputs.dtype,
            "class_labels": plan.model.inputs.class_labels,
            "use_gpu": config.use_gpu,
        },
        compute=ray.data.ActorPoolStrategy(size=config.concurrency),
        batch_size=config.batch_size,
        batch_format="numpy",
        num_cpus=per_actor,
        num_gpus=1 if config.use_gpu else 0,
    )
    try:
        predicted.write_parquet(staging.path, filesystem=staging.filesystem)
    except Exception as exc:  # noqa: BLE001 - only a refusal of the input is unwrapped; the rest is re-raised as is
        refusal = _input_refusal(exc)
        if refusal is None:
            raise
        raise ScoringInputError(str(refusal)) from None


def _input_refusal(exc: BaseException) -> ScoringInputError | None:
    """The actors' refusal of the input (rows without a value), from within Ray's wrapping of it; None if none."""
    seen: BaseException | None = exc
    while seen is not None:
        cause = getattr(seen, "cause", None)
        if isinstance(seen, ScoringInputError) and not hasattr(seen, "cause"):
            return seen
        if isinstance(cause, ScoringInputError):
            return cause
        seen = seen.__cause__ or (cause if isinstance(cause, BaseException) else None)
    return None


def _open_record(client: Any, config: ScoringConfig, plan: ScoringPlan) -> str:
    """An MLflow run for this scoring, RUNNING: which version (resolved from which URI) scores which input."""
    experiment_id = tracking.ensure_experiment(client, config.experiment_name, config.mlflow_tracking_uri, "")
    tags = {MODEL_TAG: plan.model.name, VERSION_TAG: plan.model.version, INPUT_HASH_TAG: plan.table.sha256}
    run = client.create_run(experiment_id, run_name=f"score {plan.model.name} v{plan.model.version}", tags=tags)
    params = {
        "model": config.model,
        "model_version": plan.model.version,
        "model_run_id": plan.model.run_id,
        "input_path": redact_uri(config.input_path),
        "input_files": len(plan.table.files),
        "input_sha256": plan.table.sha256,
        "output_path": redact_uri(config.output_path),
        "key_column": config.key_column,
        "features": len(plan.features.features),
        "concurrency": config.concurrency,
        "batch_size": config.batch_size,
        "use_gpu": config.use_gpu,
    }
    from mlflow.entities import Param

    client.log_batch(run.info.run_id, params=[Param(key, str(value)) for key, value in params.items()])
    return str(run.info.run_id)


def _close_record(client: Any, run_id: str, rows: int, seconds: float) -> None:
    """The run's figures, FINISHED. The output is committed by now, and records its rows itself: MLflow being
    unreachable here costs the run's figures, not the output (warned)."""
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException

    now = int(time.time() * 1000)
    figures = {"rows": rows, "seconds": seconds, "rows_per_second": rows / seconds if seconds > 0 else 0.0}
    try:
        client.log_batch(run_id, metrics=[Metric(key, float(value), now, 0) for key, value in figures.items()])
        tracking.finish_run(client, run_id)
    except (MlflowException, OSError) as exc:
        logger.warning("the output is written; could not record its %d rows in MLflow run %s: %s", rows, run_id, exc)
