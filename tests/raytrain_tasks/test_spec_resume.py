"""A TrainSpec resumed after a killed worker continues the uninterrupted trajectory, whatever random generator its
data draws from: torch's, numpy's or Python's (augmentation in a Dataset's ``__getitem__`` is the usual case)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from flows.training import training_pipeline
from raytrain_tasks.config import parameters_of
from tests.helpers import mlflow_client, only_run, run_killing_a_worker, small_config

SOURCE = """
    import random

    import numpy as np
    import torch
    from torch.utils.data import Dataset, TensorDataset

    from raytrain_tasks.api import Metric, Splits, TrainSpec

    WEIGHTS = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


    class Jittered(Dataset):
        \"\"\"Each read adds noise drawn from numpy's and Python's global generators (seeded by the pipeline).\"\"\"

        def __init__(self, inputs, targets):
            self.inputs, self.targets = inputs, targets

        def __len__(self):
            return len(self.inputs)

        def __getitem__(self, index):
            noise = np.random.normal(0.0, 0.2, size=4).astype(np.float32) + np.float32(random.gauss(0.0, 0.2))
            return self.inputs[index] + torch.from_numpy(noise), self.targets[index]


    def data(config):
        inputs = torch.randn(448, 4, generator=torch.Generator().manual_seed(0))
        targets = inputs @ WEIGHTS
        return Splits(
            Jittered(inputs[:320], targets[:320]),
            TensorDataset(inputs[320:384], targets[320:384]),
            TensorDataset(inputs[384:], targets[384:]),
        )


    training = TrainSpec(
        data=data,
        model=lambda config, example: torch.nn.Linear(example.shape[1], 1),
        loss=torch.nn.functional.mse_loss,
        metrics=lambda outputs, targets: {"mae": (outputs - targets).abs().mean()},
        metric=Metric("loss", higher_is_better=False),
        optimizer=lambda parameters, config: torch.optim.SGD(parameters, lr=0.05),
    )
"""


def _config(workdir: Path) -> Any:
    workdir.mkdir()
    return small_config(workdir, train_code="jittered_spec:training", epochs=4, batch_size=32)


@pytest.fixture
def code_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The spec as a user's module in the folder the run starts from."""
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "jittered_spec.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
@pytest.mark.usefixtures("code_dir")
def test_a_spec_whose_data_draws_from_numpy_and_python_resumes_on_the_uninterrupted_trajectory(tmp_path: Path) -> None:
    """Killed after epoch 1, the run ends with the metrics of an uninterrupted one with the same seed (to 1e-6):
    the checkpoint holds, and the resume restores, numpy's and Python's generator states beside torch's. With
    torch's alone, epochs 2-4 draw other noise and end elsewhere."""
    reference = training_pipeline(**parameters_of(_config(tmp_path / "reference")))
    expected = {int(entry["epoch"]) + 1: entry for entry in reference.fit.history}
    workdir = tmp_path / "killed"
    state, kill = run_killing_a_worker(workdir, _config(workdir), after_epoch=1, metric="val_loss")
    assert state.is_completed(), state
    assert kill.resume_epoch >= 1
    run = only_run(workdir)
    assert run is not None and run.info.status == "FINISHED"
    client = mlflow_client(workdir)
    for key in ("train_loss", "val_loss", "val_mae"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == [1, 2, 3, 4], f"{key}: every epoch exactly once"
        for metric in history:
            assert metric.value == pytest.approx(expected[metric.step][key], abs=1e-6), (key, metric.step)
