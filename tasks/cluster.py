"""Connecting to Ray: a local one by default, a cluster by address; checked before any worker starts."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import ClusterError

# Faster than Ray's 2 s default: checkpoints register sooner after report() and a 3-epoch fit of a small
# model finishes ~30% sooner (../shared/STACK.md); the controller's polling stays cheap.
HEALTH_CHECK_INTERVAL_S = "0.5"
WORKER_GROUP_START_TIMEOUT_S = "60"


@dataclass(frozen=True)
class ResourceRequest:
    cpus: float
    gpus: float


def worker_env() -> dict[str, str]:
    """Environment every Ray process of the run needs (controller and workers)."""
    env = {
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get(
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", HEALTH_CHECK_INTERVAL_S
        ),
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": os.environ.get(
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", WORKER_GROUP_START_TIMEOUT_S
        ),
        "PYTHONUNBUFFERED": "1",
    }
    return env


@contextmanager
def ray_session(config: TrainingConfig) -> Iterator[None]:
    """Yield with Ray initialised by this call, or as the caller already had it.

    A Ray the caller initialised is left alone. On exit, a local Ray we started is stopped; for a cluster
    reached by `ray_address`, ``ray.shutdown()`` only disconnects this driver and the cluster keeps running.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    runtime_env = {"env_vars": worker_env()}
    try:
        if config.ray_address:
            ray.init(address=config.ray_address, runtime_env=runtime_env, logging_level=logging.WARNING)
        else:
            # address="local" always starts a fresh cluster, never joins one left by `ray start`. The
            # dashboard stays on: Ray Train's placement-group cleaner polls the State API it serves, and
            # warns every second without it.
            ray.init(address="local", runtime_env=runtime_env, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"at {config.ray_address!r}" if config.ray_address else "locally"
        raise ClusterError(
            f"cannot start or reach Ray {where}: {exc}; check `ray_address` (empty starts a local Ray)"
        ) from exc
    try:
        yield
    finally:
        ray.shutdown()


# What Ray Data's read/preprocess tasks reserve beside the workers (raytrain_tasks.ingest.DATA_TASK_CPUS; not
# imported from there: that module loads torch).
DATA_TASK_CPUS = 0.5


def requested_resources(config: TrainingConfig) -> ResourceRequest:
    """What the smallest worker group needs (an elastic group starts with at least `num_workers`)."""
    return ResourceRequest(
        cpus=config.num_workers * config.cpus_per_worker,
        gpus=float(config.num_workers) if config.use_gpu else 0.0,
    )


def check_resources(config: TrainingConfig, available: dict[str, float]) -> None:
    """Fail in seconds when the cluster cannot host the worker group (Ray Train would wait forever)."""
    request = requested_resources(config)
    cpus, gpus = available.get("CPU", 0.0), available.get("GPU", 0.0)
    if request.gpus and gpus < request.gpus:
        raise ClusterError(
            f"use_gpu=True needs {request.gpus:g} GPUs ({config.num_workers} workers x 1) but the Ray cluster "
            f"has {gpus:g} GPUs; set `use_gpu` to false or lower `num_workers`"
        )
    if cpus < request.cpus:
        raise ClusterError(
            f"{config.num_workers} workers x {config.cpus_per_worker:g} CPUs need {request.cpus:g} CPUs but the "
            f"Ray cluster has {cpus:g} CPUs; lower `num_workers` or `cpus_per_worker`"
        )
    if config.data_loader == "ray_data" and cpus < request.cpus + DATA_TASK_CPUS:
        raise ClusterError(
            f"data_loader='ray_data' runs its read and preprocessing tasks on CPUs beside the workers, but "
            f"{config.num_workers} workers x {config.cpus_per_worker:g} CPUs take all {cpus:g} CPUs of the Ray "
            f"cluster; leave {DATA_TASK_CPUS:g} CPU free (lower `cpus_per_worker` or `num_workers`), or use "
            "data_loader='torch'"
        )
