"""Against a real `mlflow server` over HTTP: browse what a user sees in the UI, and trust the champion alias."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from flows.training import PipelineResult, training_pipeline
from raytrain_tasks.data import read_split
from tasks.register import LOCK_SUFFIX, promotion_lock
from tests.conftest import free_port, small_config, stop_process_group, wait_for_http

EXPERIMENT = "server-tests"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server` with a SQLite backend and a local artifact root, on a free port; stopped afterwards."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = (root / "server.log").open("w")
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(root / "artifacts")]
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{url}/health", server, root / "server.log", timeout=90)
        yield url
    finally:
        # The server runs its web workers as children in its own session: stop the whole group we started.
        stop_process_group(server)
        log.close()


@pytest.fixture(scope="module")
def served_run(
    mlflow_server: str, tmp_path_factory: pytest.TempPathFactory, ray_cluster: object, prefect_api: None
) -> PipelineResult:
    workdir = tmp_path_factory.mktemp("served")
    return training_pipeline(
        config=small_config(
            workdir,
            mlflow_tracking_uri=mlflow_server,
            experiment_name=EXPERIMENT,
            model_name="served",
            system_metrics=True,
        )
    )


@pytest.mark.slow
def test_a_run_as_the_ui_shows_it(served_run: PipelineResult, mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None

    # Found by its name (after the Prefect flow run) and by its run-key tag.
    by_tag = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`prefect_raytrain.run_key` = '{served_run.run_key}'"
    )
    (run,) = by_tag
    by_name = client.search_runs(
        [experiment.experiment_id], filter_string=f"attributes.run_name = '{run.info.run_name}'"
    )
    assert [r.info.run_id for r in by_name] == [run.info.run_id]
    assert run.info.run_name.endswith(served_run.run_key)
    tags = run.data.tags
    assert tags["prefect.flow_run_id"]
    assert tags["prefect_raytrain.dataset_hash"] == served_run.dataset.content_hash
    assert tags["prefect_raytrain.backend"] == "gloo" and tags["prefect_raytrain.num_workers"] == "2"
    assert run.data.params["learning_rate"] == str(served_run.config.learning_rate)

    for key in ("train_loss", "val_loss", "val_accuracy", "epoch_seconds", "samples_per_second"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [0, 1, 2]
    assert run.data.metrics["best_val_accuracy"] >= 0.9
    assert any(key.startswith("system/cpu_utilization") for key in run.data.metrics)  # system_metrics=True

    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.digest == served_run.dataset.content_hash

    artifacts = {a.path: a for a in client.list_artifacts(run.info.run_id, "evaluation")}
    for name in ("learning_curves.png", "confusion_matrix.png"):
        artifact = artifacts[f"evaluation/{name}"]
        assert artifact.file_size and artifact.file_size > 5_000
        local = client.download_artifacts(run.info.run_id, artifact.path, str(tmp_path))
        assert Path(local).read_bytes()[:8] == PNG_MAGIC
    for name in ("per_class_report.json", "dataset_summary.json", "checkpoint.json"):
        assert artifacts[f"evaluation/{name}"].file_size
    per_class = Path(client.download_artifacts(run.info.run_id, "evaluation/per_class_report.json", str(tmp_path)))
    assert len(json.loads(per_class.read_text())["per_class"]) == 10  # every digit class


@pytest.mark.slow
def test_champion_over_http_loads_and_predicts(served_run: PipelineResult, mlflow_server: str) -> None:
    import mlflow

    client = MlflowClient(mlflow_server)
    version = client.get_model_version_by_alias("served", "champion")
    assert served_run.model is not None and str(version.version) == served_run.model.version
    assert version.tags["run_key"] == served_run.run_key
    assert version.tags["promotion.decision"] == "promote"
    assert "champion" in client.get_registered_model("served").aliases
    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pyfunc.load_model("models:/served@champion")
    x_val, y_val = read_split(served_run.dataset, "val", standardised=False)  # the model takes raw features
    accuracy = float((np.asarray(model.predict(x_val)).argmax(axis=1) == y_val).mean())
    assert accuracy == pytest.approx(served_run.model.score, abs=1e-9)


def test_promotion_lock_serialises_concurrent_pipelines(mlflow_server: str) -> None:
    client = MlflowClient(mlflow_server)
    held: list[tuple[str, float, float]] = []

    def decide(owner: str) -> None:
        with promotion_lock(MlflowClient(mlflow_server), "locked-model", owner=owner):
            entered = time.monotonic()
            time.sleep(0.5)  # read champion, decide, move aliases
            held.append((owner, entered, time.monotonic()))

    threads = [threading.Thread(target=decide, args=(f"run-{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(owner for owner, _, _ in held) == ["run-0", "run-1", "run-2"]
    spans = sorted((start, end) for _, start, end in held)
    assert all(prev_end <= next_start for (_, prev_end), (next_start, _) in zip(spans, spans[1:], strict=False))
    assert not client.search_registered_models(filter_string=f"name = 'locked-model{LOCK_SUFFIX}'")


def test_a_stale_lock_left_by_a_crash_is_taken_over(mlflow_server: str) -> None:
    client = MlflowClient(mlflow_server)
    client.create_registered_model(f"crashed{LOCK_SUFFIX}", tags={"owner": "dead", "acquired_at": "0"})
    with promotion_lock(client, "crashed", owner="alive"):
        assert client.get_registered_model(f"crashed{LOCK_SUFFIX}").tags["owner"] == "alive"
