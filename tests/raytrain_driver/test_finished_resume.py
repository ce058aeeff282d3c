"""A resume of a run that finished all its epochs trains nothing, so no worker sees its data: the driver checks
that the data is still what the run trained on. A real SQLite MLflow store, no Ray."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from torch.utils.data import TensorDataset

from raytrain_tasks.api import Metric, Splits, TrainSpec
from raytrain_tasks.errors import TrackingError
from tests.helpers import fit_context, small_config
from tests.raytrain_driver.test_user_gate import finished_fit


def _data(config: dict) -> Splits:  # type: ignore[type-arg]
    rows = torch.load(config["source"])
    whole = TensorDataset(rows, 2 * rows + 0.01 * torch.randn(len(rows), 1))  # noise drawn with the run's seed
    return Splits(whole, whole, whole)


def _as_a_worker_hashes(spec: object, config: object) -> str:
    """The digest a worker records: it seeds, then calls data() (raytrain_tasks.trainspec.loop)."""
    from raytrain_tasks.trainspec.data import data_digest
    from raytrain_tasks.trainspec.loop import _splits, seed_as_workers
    from raytrain_tasks.user_code import user_config

    seed_as_workers(config.seed)  # type: ignore[attr-defined]
    return data_digest(_splits(spec.train_func.spec, user_config(config, spec)))  # type: ignore[attr-defined]


def test_a_finished_train_spec_run_refuses_a_resume_on_changed_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TrainSpec without ``prepare`` reads its own data; its finished run resumed on changed data
    would register its old scores as if they were the new data's."""
    from raytrain_driver.fit import _confirm_finished, _spec_data_digest
    from raytrain_driver.preflight import resolve_code, shown_params
    from raytrain_tasks.tracking import runs as tracking

    module = types.ModuleType("finished_spec")
    module.training = TrainSpec(  # type: ignore[attr-defined]
        data=_data,
        model=lambda config, example: torch.nn.Linear(1, 1),
        loss=torch.nn.functional.mse_loss,
        metric=Metric("loss", higher_is_better=False),
        defaults={"source": ""},
    )
    monkeypatch.setitem(sys.modules, "finished_spec", module)
    source = tmp_path / "rows.pt"
    torch.save(torch.linspace(-1, 1, 8).unsqueeze(1), source)
    fit = finished_fit(tmp_path, tmp_path)
    config = small_config(tmp_path, train_code="finished_spec:training", train_config={"source": str(source)})
    config = config.model_copy(update={"resume": fit.run_key})
    spec = resolve_code(config)
    client = MlflowClient(config.mlflow_tracking_uri)
    experiment_id = tracking.ensure_experiment(client, "tests", config.mlflow_tracking_uri, config.storage_path)
    trained_on = _as_a_worker_hashes(spec, config)
    torch.rand(5)  # the driver's random state has moved on since it started (check_data called data() once)
    assert _spec_data_digest(config, spec) == trained_on
    tags = {tracking.DATASET_HASH_TAG: trained_on}
    run_id, _ = tracking.start_or_reopen_run(client, experiment_id, fit.run_key, "r", tags, shown_params(config, spec))
    finished = fit.model_copy(update={"mlflow_run_id": run_id})

    context = fit_context(config, fit.run_key, spec=spec, client=client)
    assert _confirm_finished(context, experiment_id, finished) == finished
    torch.save(torch.linspace(-1, 1, 9).unsqueeze(1), source)  # a row more, in the same file
    with pytest.raises(TrackingError, match=f"trained on dataset {trained_on}, but its data is dataset [0-9a-f]{{64}}"):
        _confirm_finished(context, experiment_id, finished)
