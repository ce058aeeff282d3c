"""Registered versions without training, on a real SQLite MLflow store: of one small model, once per MLflow run with
the run's key as register-model does (test_champion_history, test_champions_command); or models of their own to
score, each version its champion when registered (the scoring tests)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.helpers import seed_mlflow_store

if TYPE_CHECKING:
    from mlflow import MlflowClient


def registered_versions(workdir: Path, name: str, count: int) -> tuple[str, MlflowClient, list[str]]:
    """(the store's URI, a client, ``count`` versions of ``name``: run keys 20261201-00000N-aaaaaa), no alias set."""
    import mlflow
    import torch

    from raytrain_driver.origin import VERSION_RUN_KEY_TAG
    from raytrain_tasks.tracking import runs as tracking

    uri = f"sqlite:///{seed_mlflow_store(workdir / 'mlflow.db')}"
    client = tracking.connect(uri)
    experiment = client.get_experiment_by_name(name) or client.get_experiment(
        client.create_experiment(name, artifact_location=(workdir / "artifacts").as_uri())
    )
    client.create_registered_model(name)
    # The registry finds a `models:/` source through the fluent API's store: this one, for the block.
    with tracking.using_tracking_uri(uri):
        with mlflow.start_run(experiment_id=experiment.experiment_id):
            model = mlflow.pytorch.log_model(
                torch.nn.Linear(2, 1),
                name="model",
                serialization_format="pt2",
                input_example=torch.zeros(1, 2).numpy(),
                pip_requirements=[],
            )
        versions = []
        for index in range(1, count + 1):  # one run each, all of the one small model (exporting one takes seconds)
            run_key = f"20261201-00000{index}-aaaaaa"
            run_id = client.create_run(experiment.experiment_id, run_name=run_key).info.run_id
            created = client.create_model_version(
                name, source=model.model_uri, run_id=run_id, tags={VERSION_RUN_KEY_TAG: run_key}
            )
            versions.append(str(created.version))
    return uri, client, versions


def register_pt2(
    store: str, name: str, width: int, outputs: int, metadata: dict[str, Any] | None = None, seed: int = 0
) -> str:
    """A version of ``name``, now its champion, as register-model logs one (pt2, an input example, no pickles):
    a linear model of ``width`` inputs, its weights drawn from ``seed``; for scoring tests, without training."""
    import mlflow
    import numpy as np
    import torch
    from mlflow import MlflowClient

    from raytrain_tasks.tracking import runs as tracking
    from raytrain_tasks.tracking.runs import using_tracking_uri

    client = MlflowClient(store, registry_uri=store)
    # Artifacts beside the store's database (a bare create_experiment puts them under ./mlruns).
    experiment = client.get_experiment(tracking.ensure_experiment(client, "models", store, ""))
    torch.manual_seed(seed)
    with using_tracking_uri(store), mlflow.start_run(experiment_id=experiment.experiment_id):
        info = mlflow.pytorch.log_model(
            torch.nn.Linear(width, outputs),
            name="model",
            input_example=np.zeros((2, width), np.float32),
            serialization_format="pt2",
            pip_requirements=[],
            metadata=metadata or {},
        )
        version = str(mlflow.register_model(info.model_uri, name).version)
    client.set_registered_model_alias(name, "champion", version)
    return version
