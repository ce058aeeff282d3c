"""The checkpoint format: model, optimizer, epoch, RNG state and what is needed to rebuild the model.

A checkpoint directory is complete only when ``manifest.json`` is present and every file it lists has
the recorded size and SHA-256. The manifest is written last, so an interrupted write is never mistaken
for a checkpoint, and a truncated or corrupted file in storage is detected before anything is loaded.

A checkpoint is data, never code: every ``.pt`` file is loaded with ``torch.load(weights_only=True)``, which
rebuilds tensors and plain values and refuses any other pickled object before it is created. The RNG state is
stored that way too (format 2). Format-1 checkpoints kept numpy's RNG state as a pickled object: their
weights and optimizer still load, their ``rng.pt`` is never unpickled (the run continues with fresh RNG state).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain_tasks.errors import CheckpointError, UnsafeCheckpointError

if TYPE_CHECKING:
    import torch

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
# 1: rng.pt held numpy's state as a pickled object. 2: every .pt file loads with weights_only=True.
FORMAT_VERSION = 2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """Enough to rebuild the network without the config that trained it."""

    model: str
    in_features: int
    num_classes: int
    hidden_sizes: tuple[int, ...]
    feature_names: tuple[str, ...] = ()
    class_labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrainingState:
    """The non-tensor part of a checkpoint."""

    epoch: int
    metrics: dict[str, float]
    spec: ModelSpec
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class LoadedCheckpoint:
    state: TrainingState
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any] | None
    rng_state: dict[str, Any] | None


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


def save_checkpoint(
    directory: str | Path,
    *,
    state: TrainingState,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None = None,
    rng_state: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint into ``directory`` (created if missing)."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model_state, directory / MODEL_FILE)
    if optimizer_state is not None:
        torch.save(optimizer_state, directory / OPTIMIZER_FILE)
    if rng_state is not None:
        torch.save(rng_state, directory / RNG_FILE)
    (directory / STATE_FILE).write_text(json.dumps(_state_to_json(state), indent=1))
    files = {
        path.name: {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(directory.iterdir())
        if path.name != MANIFEST_FILE
    }
    # Written last: a directory without it is an incomplete checkpoint.
    manifest = {"format_version": FORMAT_VERSION, "torch_version": torch.__version__, "files": files}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return directory


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


def verify_checkpoint(directory: str | Path) -> int:
    """Raise CheckpointError unless every file the manifest lists is present and intact; return its format."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: {MANIFEST_FILE} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        format_version = int(manifest.get("format_version", 1))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST_FILE} is unreadable ({exc})") from exc
    if format_version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {directory} has format {format_version}, newer than this version of prefect-raytrain "
            f"reads ({FORMAT_VERSION}); upgrade prefect-raytrain on the driver and the Ray nodes"
        )
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"checkpoint {directory} is corrupted: {name} has {size} bytes, expected {expected['bytes']}"
            )
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {directory} is corrupted: {name} fails its SHA-256 check")
    return format_version


def manifest_digest(directory: str | Path) -> str:
    """SHA-256 of the checkpoint's manifest: it pins every file of the checkpoint (sizes and hashes)."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: {MANIFEST_FILE} is missing")
    return _sha256(path)


def load_tensors(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load`` that rebuilds only tensors and plain values; anything else is refused, never created."""
    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except RuntimeError as exc:
        if TOO_NEW_FOR_THIS_TORCH.search(str(exc)):
            # torch's own archive version check, before anything is unpickled: an older torch than the one that
            # wrote the file, not tampering. The resume falls back to an older checkpoint this torch can read.
            written_by = _manifest_field(path.parent, "torch_version") or "a newer version"
            raise CheckpointError(
                f"checkpoint file {path} was written by torch {written_by}, which this worker's torch "
                f"{torch.__version__} cannot read ({str(exc).splitlines()[0][:300]}). Install the same torch on the "
                "driver and every Ray node as the run trained with"
            ) from exc
        raise _unsafe(path, exc) from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise _unsafe(path, exc) from exc


# What torch says when a file's archive format is newer than it reads (seen on torch 2.13: "Attempted to read a
# PyTorch file with version 99, but the maximum supported version for reading is 10. The version of your PyTorch
# installation may be too old, ...").
TOO_NEW_FOR_THIS_TORCH = re.compile(r"maximum supported version for reading|PyTorch installation may be too old")


def _manifest_field(directory: Path, key: str) -> str:
    try:
        return str(json.loads((directory / MANIFEST_FILE).read_text()).get(key, ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _unsafe(path: Path, exc: BaseException) -> UnsafeCheckpointError:
    # weights_only=True raises UnpicklingError for a pickled object it does not allow (nothing of it is created);
    # the others come from a damaged archive.
    return UnsafeCheckpointError(
        f"checkpoint file {path} holds something other than tensors and plain values and was not loaded "
        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). A checkpoint is data, never "
        "code: someone or something other than prefect-raytrain wrote this file. Check who can write "
        "`storage_path`, then start a new run (without `resume`) or restore the checkpoint from a backup"
    )


def load_checkpoint(directory: str | Path, map_location: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Verify, then load everything a worker needs to resume: weights, optimizer and RNG state."""
    directory = Path(directory)
    format_version = verify_checkpoint(directory)
    state = _read_state(directory)
    model_state = load_tensors(directory / MODEL_FILE, map_location)
    optimizer_state = None
    if (directory / OPTIMIZER_FILE).is_file():
        optimizer_state = load_tensors(directory / OPTIMIZER_FILE, map_location)
    rng_state = None
    if (directory / RNG_FILE).is_file():
        if format_version < 2:
            logger.warning(
                "checkpoint %s has format %d, whose %s can only be read by full unpickling; it is not loaded and "
                "training continues with fresh RNG state (data order and dropout differ from an uninterrupted run)",
                directory,
                format_version,
                RNG_FILE,
            )
        else:
            rng_state = load_tensors(directory / RNG_FILE)
    return LoadedCheckpoint(state, model_state, optimizer_state, rng_state)


def load_weights(directory: str | Path) -> tuple[TrainingState, dict[str, Any]]:
    """Verify, then load only what scoring and registration need: the state record and the model weights."""
    directory = Path(directory)
    verify_checkpoint(directory)
    return _read_state(directory), load_tensors(directory / MODEL_FILE)


def _read_state(directory: Path) -> TrainingState:
    try:
        return _state_from_json(json.loads((directory / STATE_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {directory}: {STATE_FILE} is missing or unreadable ({exc})") from exc


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _state_to_json(state: TrainingState) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, **asdict(state)}


def _state_from_json(raw: dict[str, Any]) -> TrainingState:
    spec = raw["spec"]
    return TrainingState(
        epoch=int(raw["epoch"]),
        metrics={k: float(v) for k, v in raw["metrics"].items()},
        spec=ModelSpec(
            model=spec["model"],
            in_features=int(spec["in_features"]),
            num_classes=int(spec["num_classes"]),
            hidden_sizes=tuple(spec["hidden_sizes"]),
            feature_names=tuple(spec.get("feature_names", ())),
            class_labels=tuple(spec.get("class_labels", ())),
        ),
        history=list(raw.get("history", [])),
    )
