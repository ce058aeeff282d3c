"""The checkpoints the pipeline writes for a TrainSpec: what each holds (model, optimizer, the RNG state of torch,
numpy and Python as tensors and plain values that ``torch.load(weights_only=True)`` reads, the epoch and step), the
local folder a worker writes it into before Ray Train uploads it, and where a resume from one starts."""

from __future__ import annotations

import logging
import os
import random
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raytrain_tasks.errors import DataRefusedError
from raytrain_tasks.tracking.names import IN_EPOCH_KEY
from raytrain_tasks.trainspec.within_epoch import EpochSoFar

logger = logging.getLogger(__name__)
STATE_FILE = "spec_state.pt"  # a TrainSpec checkpoint's one file (torch.save of plain values and tensors)


def capture_rng_state() -> dict[str, Any]:
    """The torch, numpy and Python RNG states as tensors and plain values (loadable with weights_only=True)."""
    import torch

    _kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available():
        # This worker's device alone: Ray Train shows each worker every GPU of its node, and a resume may run on a
        # node with fewer (an elastic group), where a state per device of the old node has nowhere to go.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["keys"].numpy().astype(np.uint32),
            int(numpy_state["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["cached_gaussian"]),
        )
    )
    python_state = state["python"]
    random.setstate(
        (
            int(python_state["version"]),
            tuple(int(x) for x in python_state["state"].tolist()),
            python_state["gauss_next"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, list | tuple):  # an earlier release's, one state per device of the node
            device = torch.cuda.current_device()
            cuda = cuda[device] if device < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


STAGING_PREFIX = "prefect-raytrain-staging-"


@contextmanager
def staging_folder(run_key: str | None) -> Iterator[Path]:
    """An empty local folder to write one checkpoint into before Ray Train copies it to storage; removed after.

    A worker killed while it writes or uploads a checkpoint cannot remove its folder. With a run key the folder
    is ``<temp dir>/prefect-raytrain-staging-<uid>/<run key>``: the run's next checkpoint on that node (after
    Ray Train or Prefect restarts it, or a resume) removes what the killed attempt left, so a run that is killed
    night after night does not fill the disk with copies of its model. Only one driver holds a run key at a time
    (the run lease) and only rank 0 writes, so nothing else uses that folder. The parent is this user's own
    (mode 0700, not a link); if it is anything else, or there is no run key, a fresh temporary folder is used,
    as before, and nothing is removed but it.
    """
    root = _staging_root() if run_key else None
    if root is None or run_key is None:
        with tempfile.TemporaryDirectory(prefix="prt-ckpt-") as tmp:
            yield Path(tmp)
        return
    folder = root / run_key
    shutil.rmtree(folder, ignore_errors=True)  # what a killed attempt of this run left on this node
    folder.mkdir(mode=0o700)  # FileExistsError if it could not be removed: this checkpoint fails, loudly
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def this_runs_staging_folder() -> AbstractContextManager[Path]:
    """``staging_folder`` of the Ray Train run this worker trains in, named after its run key (raytrain_driver.fit);
    a run of another name (a TorchTrainer of one's own) gets a fresh temporary folder."""
    import ray.train

    from raytrain_tasks.config import RUN_KEY_PATTERN

    run_name = ray.train.get_context().get_experiment_name()
    return staging_folder(run_name if RUN_KEY_PATTERN.fullmatch(run_name) else None)


def _staging_root() -> Path | None:
    """This user's private staging parent in the temp dir; None (with a warning) where it is not safe to use."""
    root = Path(tempfile.gettempdir()) / f"{STAGING_PREFIX}{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(root)
    except OSError as exc:
        logger.warning("checkpoint staging folder %s is not usable (%s): using a fresh temporary folder", root, exc)
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        logger.warning(
            "checkpoint staging folder %s is not a private folder of this user (a link, another owner, or open "
            "to others): using a fresh temporary folder",
            root,
        )
        return None
    return root


def report_state(
    metrics: dict[str, Any], model: Any, optimizer: Any, digest: str, folder_name: str, extra: dict[str, Any]
) -> None:
    """``metrics`` and (rank 0 alone writes it) a checkpoint in folder ``folder_name``: model, optimizer, RNG, the
    epoch it holds, and ``extra`` (the global step; how far an epoch got, for one taken within it)."""
    import ray.train

    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=folder_name)
        return
    # Written where the run's next checkpoint on this node removes what a killed attempt left (a worker killed
    # while it writes or uploads cannot remove its folder).
    with this_runs_staging_folder() as folder:
        state = {
            "model": {k: v.detach().cpu() for k, v in getattr(model, "module", model).state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "rng": capture_rng_state(),  # torch, numpy and Python's: user code draws from any of them
            "epoch": metrics.get("epoch", metrics.get(IN_EPOCH_KEY)),
            "data_sha256": digest,
            **{key: value.as_state() if isinstance(value, EpochSoFar) else value for key, value in extra.items()},
        }
        torch.save(state, folder / STATE_FILE)
        checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=folder_name)


@dataclass(frozen=True)
class Resumed:
    """Where a worker group starts: at epoch ``epoch`` (0-based), part-way through it when ``in_epoch`` says how
    far a checkpoint within it got."""

    epoch: int = 0
    in_epoch: EpochSoFar | None = None
    step: int | None = None  # the global step the checkpoint holds; None: an earlier release's, which had none

    def global_step(self, steps_in_epoch: int | None) -> int:
        if self.step is not None:
            return self.step
        return self.epoch * (steps_in_epoch or 0)


def resume_state(model: Any, optimizer: Any, digest: str) -> Resumed:
    """Where to start: epoch 0, the one after the last committed epoch checkpoint, or the step after a checkpoint
    within an epoch (model, optimizer, RNG restored: rank 0's, on every rank, as every rank was seeded alike and
    draws alike)."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return Resumed()
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=True)
    # "" on either side: the data is pinned by prepare's stored version (an older release hashed it here too).
    if state["data_sha256"] and digest and state["data_sha256"] != digest:
        raise DataRefusedError(
            f"the data changed since this run's last checkpoint (content hash {state['data_sha256'][:12]}... then, "
            f"{digest[:12]}... now): a resume continues on the data it started with. Start a new run instead"
        )
    getattr(model, "module", model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if isinstance(state["rng"], torch.Tensor):  # a checkpoint of an earlier release: torch's state alone
        torch.set_rng_state(state["rng"])
    else:
        restore_rng_state(state["rng"])
    step = int(state["global_step"]) if "global_step" in state else None
    if "in_epoch" in state:
        return Resumed(int(state["epoch"]), EpochSoFar.from_state(state["in_epoch"]), step)
    return Resumed(int(state["epoch"]) + 1, None, step)
