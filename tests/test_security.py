"""What storage holds is data, never code; what names a folder or a filter is checked first.

A writer of the checkpoint storage is the attacker here: it replaces a checkpoint file with a pickle that
creates a file when unpickled, and rewrites the manifest so that the checkpoint is self-consistent.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from raytrain_tasks.checkpoint import (
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    ModelSpec,
    TrainingState,
    capture_rng_state,
    load_checkpoint,
    load_weights,
    restore_rng_state,
    save_checkpoint,
)
from raytrain_tasks.config import TrainingConfig, check_run_key
from raytrain_tasks.errors import UnsafeCheckpointError
from raytrain_tasks.models import build_model

SPEC = ModelSpec(model="mlp", in_features=8, num_classes=3, hidden_sizes=(16,))


class CreatesAFile:
    """Unpickling this creates ``path``: the proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def write_checkpoint(directory: Path) -> Path:
    model = build_model("mlp", 8, 3, [16])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return save_checkpoint(
        directory,
        state=TrainingState(epoch=1, metrics={"val_accuracy": 0.5}, spec=SPEC),
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        rng_state=capture_rng_state(),
    )


def rewrite_manifest(directory: Path, format_version: int | None = None) -> None:
    """What an attacker with write access does: make the manifest match the replaced files."""
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    for name in manifest["files"]:
        data = (directory / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if format_version is not None:
        manifest["format_version"] = format_version
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", [MODEL_FILE, OPTIMIZER_FILE, RNG_FILE])
@pytest.mark.parametrize("how", ["torch.save", "plain pickle"])
def test_a_checkpoint_file_carrying_a_pickle_is_refused_and_never_runs(tmp_path: Path, name: str, how: str) -> None:
    directory = write_checkpoint(tmp_path / "epoch-0001")
    marker = tmp_path / "pwned"
    if how == "torch.save":
        torch.save({"state": CreatesAFile(marker)}, directory / name)
    else:
        (directory / name).write_bytes(pickle.dumps(CreatesAFile(marker)))
    rewrite_manifest(directory)

    with pytest.raises(UnsafeCheckpointError, match=name) as refused:
        load_checkpoint(directory)
    assert "storage_path" in str(refused.value)  # says what to check
    if name == MODEL_FILE:  # the driver's loader (scoring, registration) reads only the weights
        with pytest.raises(UnsafeCheckpointError, match=name):
            load_weights(directory)
    assert not marker.exists()


def test_rng_state_round_trips_without_any_pickled_object(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.random(), np.random.rand(), np.random.randn()  # a cached Gaussian is part of numpy's state
    directory = write_checkpoint(tmp_path / "c")
    expected = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist())
    random.seed(99), np.random.seed(99), torch.manual_seed(99)

    # The file loads with the restricted unpickler alone.
    torch.load(directory / RNG_FILE, weights_only=True)
    loaded = load_checkpoint(directory)
    assert loaded.rng_state is not None
    restore_rng_state(loaded.rng_state)
    assert (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist()) == expected


def test_a_format_1_checkpoint_loads_its_weights_and_never_unpickles_its_rng_file(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "old")
    marker = tmp_path / "pwned"
    # Format 1 kept numpy's state as a pickled object: here, one that would run code.
    torch.save({"numpy": CreatesAFile(marker)}, directory / RNG_FILE)
    rewrite_manifest(directory, format_version=1)

    loaded = load_checkpoint(directory)
    assert loaded.rng_state is None and loaded.optimizer_state is not None
    assert set(loaded.model_state) == set(build_model("mlp", 8, 3, [16]).state_dict())
    assert not marker.exists()


def test_resume_does_not_fall_back_past_a_tampered_checkpoint(tmp_path: Path) -> None:
    """An older checkpoint of storage someone tampered with is no safer: the resume stops and says why."""
    import pyarrow.fs as pafs
    from ray.train import Checkpoint

    from raytrain_tasks.resume import load_newest_intact

    run_dir = tmp_path / "run"
    write_checkpoint(run_dir / "epoch-0000")
    latest = write_checkpoint(run_dir / "epoch-0001")
    marker = tmp_path / "pwned"
    torch.save(CreatesAFile(marker), latest / RNG_FILE)
    rewrite_manifest(latest)

    with pytest.raises(UnsafeCheckpointError, match=RNG_FILE):
        load_newest_intact(Checkpoint(str(latest), pafs.LocalFileSystem()), announce=False)
    assert not marker.exists()


@pytest.mark.parametrize(
    "value",
    ["1-2-../../x", "20261122-101500-../../etc", "20261122-101500-a1b2c3/../x", "20261122-101500-A1B2C3",
     "20261122-101500-a1b2c3' or '1'='1", "20261122-101500-a1b2c", " 20261122-101500-a1b2c3"],
)  # fmt: skip
def test_only_the_exact_run_key_format_is_accepted(value: str) -> None:
    with pytest.raises(ValidationError, match="is not a run key"):
        TrainingConfig(resume=value)
    with pytest.raises(ValueError, match="is not a run key"):
        check_run_key(value)
    assert TrainingConfig(resume="20261122-101500-a1b2c3").resume == "20261122-101500-a1b2c3"


def test_a_run_key_that_skipped_the_config_never_reaches_a_path_or_filter(tmp_path: Path) -> None:
    """The fit and registry entry points check the key themselves: a caller may pass one that is not from a config."""
    from mlflow import MlflowClient

    from tasks.register import _version_of_run
    from tasks.tracking import find_run

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(ValueError, match="is not a run key"):
        find_run(client, "0", "x' or tags.run_key != '")
    with pytest.raises(ValueError, match="is not a run key"):
        _version_of_run(client, "model", "../../x")
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("name", ["it's", 'a"b', "a\\b", "", " leading"])
def test_a_model_name_that_would_break_a_registry_filter_is_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="model_name"):
        TrainingConfig(model_name=name)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_registration_refuses_a_tampered_best_checkpoint_and_registers_nothing(tmp_path: Path) -> None:
    """The driver loads only the weights of the best checkpoint; a pickle there is refused before anything is
    logged or registered, and the code in it never runs."""
    from mlflow import MlflowClient

    from flows.training import training_pipeline
    from tests.conftest import small_config

    config = small_config(tmp_path, epochs=2, register=False)
    first = training_pipeline(config=config)
    best = Path(first.fit.best_checkpoint_uri)
    marker = tmp_path / "pwned"
    torch.save({"fc.weight": CreatesAFile(marker)}, best / MODEL_FILE)
    rewrite_manifest(best)

    resumed = config.model_copy(update={"resume": first.run_key, "register": True})
    state = training_pipeline(config=resumed, return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, UnsafeCheckpointError) and MODEL_FILE in str(error), error
    assert not marker.exists()
    client = MlflowClient(config.mlflow_tracking_uri)
    assert client.search_registered_models() == []
    assert client.search_logged_models([first.fit.mlflow_experiment_id]) == []
