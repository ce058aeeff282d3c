"""The checkpoint format: model, optimizer, epoch, RNG state and what is needed to rebuild the model.

A checkpoint directory is complete only when ``manifest.json`` is present and every file it lists has
the recorded size and SHA-256. The manifest is written last, so an interrupted write is never mistaken
for a checkpoint, and a truncated or corrupted file in storage is detected before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain_tasks.errors import CheckpointError

if TYPE_CHECKING:
    import torch

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


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
    import torch

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    (directory / MANIFEST_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "files": files}, indent=1))
    return directory


def verify_checkpoint(directory: str | Path) -> None:
    """Raise CheckpointError unless every file the manifest lists is present and intact."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: {MANIFEST_FILE} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST_FILE} is unreadable ({exc})") from exc
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


def load_checkpoint(directory: str | Path, map_location: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Verify, then load a checkpoint written by ``save_checkpoint``."""
    import torch

    directory = Path(directory)
    verify_checkpoint(directory)
    state = _state_from_json(json.loads((directory / STATE_FILE).read_text()))
    model_state = torch.load(directory / MODEL_FILE, map_location=map_location, weights_only=True)
    optimizer_state = None
    if (directory / OPTIMIZER_FILE).is_file():
        optimizer_state = torch.load(directory / OPTIMIZER_FILE, map_location=map_location, weights_only=True)
    rng_state = None
    if (directory / RNG_FILE).is_file():
        # Our own file, verified above; numpy's RNG state needs full unpickling.
        rng_state = torch.load(directory / RNG_FILE, weights_only=False)
    return LoadedCheckpoint(state, model_state, optimizer_state, rng_state)


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
