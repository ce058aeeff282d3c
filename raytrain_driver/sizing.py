"""What the Ray cluster can host, checked before any worker starts: workers sized to its CPUs, the resources
they ask for, and storage every node can use."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import ClusterError, NodeStorageError
from raytrain_tasks.redact import redact
from raytrain_tasks.storage.filesystem import StorageOptions, is_s3

# CPU that each Ray Data read/preprocess task reserves beside the training workers, where a dataset streams.
DATA_TASK_CPUS = 0.5
# Left free beside the workers for the Ray Datasets of the user's code (TrainFunc datasets=...): their read and
# transform tasks ask Ray Data's default of 1 CPU each, and none could start on less.
USER_DATASET_CPUS = 1.0


@dataclass(frozen=True)
class ResourceRequest:
    cpus: float
    gpus: float


def storage_shared_with_nodes(storage_path: str, node_count: int, mounts: str, setting: str = "storage_path") -> None:
    """Fail when several Ray nodes would each see their own local `storage_path` (checkpoints lost), or the local
    path of another ``setting`` (a scoring run's input or output)."""
    if node_count <= 1 or is_s3(storage_path):
        return
    fstype = _mount_fstype(storage_path, mounts)
    if fstype and fstype.split(".")[0] in SHARED_FILESYSTEMS:
        return
    raise ClusterError(
        f"{setting} {storage_path!r} is a local path ({fstype or 'unknown'} filesystem) but the Ray "
        f"cluster has {node_count} nodes, and each would see its own copy; set `{setting}` to "
        "s3://bucket/prefix, or to a shared filesystem (NFS, EFS, Lustre, ...) mounted at the same path on every node"
    )


SHARED_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "beegfs", "fuse"}


def _mount_fstype(path: str, mounts: str) -> str:
    """The filesystem type of the longest mount point containing `path`, from /proc/mounts text."""
    best, fstype = "", ""
    target = os.path.abspath(path)
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, fields[2]
    return fstype


NODE_PROBE_TIMEOUT_S = 60.0


def check_storage_on_nodes(storage_uri: str, options: StorageOptions, timeout_s: float = NODE_PROBE_TIMEOUT_S) -> int:
    """On every alive node of a cluster, before any worker starts: the node itself can write, read and delete under
    `storage_uri` with its own credentials. NodeStorageError (not retried) naming each node that cannot; returns
    how many were probed.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_tasks.storage.filesystem import probe_storage

    probe = ray.remote(num_cpus=0, max_retries=0)(probe_storage)
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    pending = {
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
            storage_uri, options
        ): f"{node['NodeManagerAddress']} (node {node['NodeID'][:12]})"
        for node in nodes
    }
    ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    problems = [f"{pending[ref]}: {redact(ray.get(ref))}" for ref in ready if ray.get(ref)]
    problems += [f"{pending[ref]}: no answer within {timeout_s:.0f} s" for ref in not_ready]
    for ref in not_ready:
        ray.cancel(ref, force=True)
    if problems:
        raise NodeStorageError(
            f"storage {storage_uri} is not usable from every Ray node, so workers there would fail mid-run: "
            f"{'; '.join(problems)}. Give those nodes credentials that can write `storage_path` (instance or pod "
            "role, or AWS_* in their environment), or set `forward_credentials_to_cluster`"
        )
    return len(nodes)


def alive_node_resources() -> list[dict[str, float]]:
    """The resources (CPU, GPU, object store ...) of each alive node of the connected Ray."""
    import ray

    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def read_mounts() -> str:
    try:
        with open("/proc/mounts") as mounts:
            return mounts.read()
    except OSError:
        return ""


class FitPlan(BaseModel):
    """The worker group a fit starts, decided once before any worker starts: the user's settings where they fix
    it, the cluster's share where `cpus_per_worker` is unset (``sized_for_cluster``). Everything that starts
    workers reads this; the user's settings are never rewritten (they are the run's MLflow params)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus_per_worker: float = Field(gt=0)
    min_workers: int = Field(ge=1)
    max_workers: int = Field(ge=1)
    use_gpu: bool = False
    sized: bool = False  # cpus_per_worker was unset and is the cluster's share

    @model_validator(mode="after")
    def _range(self) -> FitPlan:
        if self.max_workers < self.min_workers:
            raise ValueError(f"max_workers {self.max_workers} is below min_workers {self.min_workers}")
        return self

    @classmethod
    def of(cls, config: TrainingConfig, sized_share: float = 0.0) -> FitPlan:
        """The plan of ``config``, with ``sized_share`` as the CPUs of each worker where the setting is unset."""
        low, high = config.worker_range
        share = config.cpus_per_worker or sized_share
        return cls(
            cpus_per_worker=share,
            min_workers=low,
            max_workers=high,
            use_gpu=config.use_gpu,
            sized=not config.cpus_per_worker,
        )

    @property
    def backend(self) -> Literal["nccl", "gloo"]:
        return "nccl" if self.use_gpu else "gloo"

    @property
    def elastic(self) -> bool:
        return self.max_workers > self.min_workers

    @property
    def fixed_workers(self) -> int:
        """The worker group's size when it is fixed (what a kept split is divided among); 0 when elastic."""
        return 0 if self.elastic else self.min_workers


# The least CPU an automatically sized worker gets; smaller shares must be set by hand.
MIN_SIZED_CPUS = 0.5


def sized_for_cluster(
    config: TrainingConfig,
    nodes: list[dict[str, float]],
    streams: bool,
    earlier: float | None = None,
    data_cpus: float = DATA_TASK_CPUS,
) -> FitPlan:
    """The plan of ``config``, with ``cpus_per_worker`` sized when it is 0 (unset): the largest share (in
    hundredths of a CPU) such that the run's most workers fit on the alive nodes, no worker spanning two nodes
    (nor, with ``use_gpu``, two workers sharing a GPU), and, when a Ray Data pipeline ``streams`` beside the
    workers, ``data_cpus`` left free for its tasks. ``nodes``: each alive node's resources. The setting when set; when
    nothing fits in shares of at least ``MIN_SIZED_CPUS``, that much, and ``check_resources`` says what is missing
    (eight workers on two CPUs is a mistake to report, not a run of starved processes).

    ``earlier``: the share an earlier attempt of the same run trained with (a Prefect retry, a resume). It is kept
    while at least ``num_workers`` fit at it: an elastic run on a cluster that lost a node continues with fewer
    workers of the same size (what ``max_workers`` is for), not with ``max_workers`` squeezed onto what is left.
    A fixed worker count that no longer fits at it is sized anew."""
    if config.cpus_per_worker:
        return FitPlan.of(config)
    workers = config.worker_range[1]
    largest_first = sorted(nodes, key=lambda node: node.get("CPU", 0.0), reverse=True)
    cpus = [node.get("CPU", 0.0) for node in largest_first]
    gpus = [node.get("GPU", 0.0) for node in largest_first]
    if streams and cpus:
        cpus[0] -= data_cpus  # the streaming tasks' CPU, taken where it hurts the packing least

    def hosted(share: float) -> int:
        fits = [int(c / share + 1e-9) for c in cpus]
        if config.use_gpu:
            fits = [min(f, int(g)) for f, g in zip(fits, gpus, strict=True)]
        return sum(fits)

    if earlier is not None and earlier >= MIN_SIZED_CPUS and hosted(earlier) >= config.worker_range[0]:
        return FitPlan.of(config, earlier)
    candidates = sorted({int(c / k * 100 + 1e-9) / 100 for c in cpus for k in range(1, workers + 1)}, reverse=True)
    share = next((c for c in candidates if c >= MIN_SIZED_CPUS and hosted(c) >= workers), MIN_SIZED_CPUS)
    return FitPlan.of(config, share)


def requested_resources(plan: FitPlan) -> ResourceRequest:
    """What the smallest worker group needs (an elastic group starts with at least `num_workers`)."""
    return ResourceRequest(
        cpus=plan.min_workers * plan.cpus_per_worker,
        gpus=float(plan.min_workers) if plan.use_gpu else 0.0,
    )


def check_resources(
    config: TrainingConfig,
    plan: FitPlan,
    available: dict[str, float],
    streams: bool = False,
    user_datasets: bool = False,
    data_cpus: float = DATA_TASK_CPUS,
) -> None:
    """Fail in seconds when the cluster cannot host the worker group ``plan`` (``sized_for_cluster``) for
    ``config`` (Ray Train would wait forever); ``streams``: a Ray Data pipeline runs tasks beside the workers (a
    TrainSpec's streamed splits, or ``user_datasets``: the ``datasets`` of the user's TrainFunc)."""
    request = requested_resources(plan)
    workers, share = plan.min_workers, plan.cpus_per_worker
    cpus, gpus = available.get("CPU", 0.0), available.get("GPU", 0.0)
    if request.gpus and gpus < request.gpus:
        raise ClusterError(
            f"use_gpu=True needs {request.gpus:g} GPUs ({workers} workers x 1) but the Ray cluster "
            f"has {gpus:g} GPUs; set `use_gpu` to false or lower `num_workers`"
        )
    if cpus < request.cpus:
        raise ClusterError(
            f"{workers} workers x {share:g} CPUs need {request.cpus:g} CPUs but the "
            f"Ray cluster has {cpus:g} CPUs; lower `num_workers` or `cpus_per_worker`"
        )
    if streams and cpus < request.cpus + data_cpus and user_datasets:
        raise ClusterError(
            f"train_code {config.train_code!r} gives Ray Datasets (TrainFunc datasets=...), whose tasks run on CPUs "
            f"beside the workers, but {workers} workers x {share:g} CPUs leave less "
            f"than {data_cpus:g} of the Ray cluster's {cpus:g} CPUs free, and the datasets would never be read; "
            f"leave {data_cpus:g} CPU free "
            "(set `cpus_per_worker` to 0 to size it automatically, or lower it or `num_workers`)"
        )
    if streams and cpus < request.cpus + data_cpus:
        raise ClusterError(
            f"train_code {config.train_code!r} streams its Ray Datasets (too big to keep in Ray's object store) "
            f"through read and preprocessing tasks on CPUs beside the workers, but {workers} workers x "
            f"{share:g} CPUs take all {cpus:g} CPUs of the Ray cluster; leave {DATA_TASK_CPUS:g} "
            "CPU free (set `cpus_per_worker` to 0 to size it automatically, or lower it or `num_workers`)"
        )
