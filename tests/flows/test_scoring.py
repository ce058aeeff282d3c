"""The `score` flow for real: the session's local Ray, the Prefect test API, a SQLite registry, inputs on a local
folder and on the S3 server. The module's runs are made once; the rules (columns, refusals, the output's commit)
are tested without Ray in tests/raytrain_driver/test_scoring_plan.py and test_scoring_output.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from devtools.s3_server import LocalS3
from flows.scoring import scoring_pipeline
from raytrain_driver.scoring import plan_scoring
from raytrain_driver.scoring_run import INPUT_HASH_TAG, VERSION_TAG, score
from raytrain_tasks.scoring.config import ScoringConfig
from tests.helpers import CLIENT_ENV, REPO_ROOT, seed_mlflow_store, wait_for
from tests.registered_versions import register_pt2

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster", "prefect_api")]

ROWS = 3000
LABELLED = {"feature_names": ["b", "d"], "class_labels": ["cat", "dog"]}


def _table(rows: int = ROWS) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    keys = [f"{index * 7:07d}" for index in range(rows)]  # zero-padded: a key is text, copied as it is
    return pd.DataFrame({"id": keys, **{name: rng.random(rows) for name in "abcd"}})


def _expected(store: str, uri: str, table: pd.DataFrame, columns: list[str]) -> np.ndarray:
    """What the registered model predicts for ``table``, called in this process."""
    import mlflow.pytorch
    import torch

    from raytrain_tasks.safe_load import pickle_deserialization_off
    from raytrain_tasks.tracking.runs import using_tracking_uri

    with using_tracking_uri(store), pickle_deserialization_off():
        module = mlflow.pytorch.load_model(uri)
    with torch.no_grad():
        return module(torch.tensor(table[columns].to_numpy(), dtype=torch.float32)).numpy()


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory, s3_server: LocalS3) -> SimpleNamespace:
    workdir = tmp_path_factory.mktemp("scoring")
    store = f"sqlite:///{seed_mlflow_store(workdir / 'mlflow.db')}"
    register_pt2(store, "churn", width=4, outputs=1, seed=1)
    register_pt2(store, "churn", width=4, outputs=1, seed=2)  # version 2, the champion
    register_pt2(store, "kinds", width=2, outputs=2, metadata=LABELLED, seed=3)
    table = _table()
    (workdir / "in").mkdir()
    for index, start in enumerate(range(0, ROWS, ROWS // 3)):
        table[start : start + ROWS // 3].to_csv(workdir / "in" / f"part-{index}.csv", index=False)
    local = {"input_path": str(workdir / "in"), "mlflow_tracking_uri": store}
    first = scoring_pipeline(model="models:/churn@champion", output_path=str(workdir / "out.parquet"), **local)
    again = scoring_pipeline(model="models:/churn@champion", output_path=str(workdir / "out.parquet"), **local)

    # The alias moves after the run resolved it, as a nightly promotion would mid-run: the run keeps its version.
    config = ScoringConfig(model="models:/churn@champion", output_path=str(workdir / "pinned.parquet"), **local)
    plan = plan_scoring(config, workdir / "scratch")
    MlflowClient(store, registry_uri=store).set_registered_model_alias("churn", "champion", "1")
    pinned = score(config, plan)

    s3 = _on_s3(workdir, s3_server, store, table)
    return SimpleNamespace(
        workdir=workdir, store=store, table=table, first=first, again=again, pinned=pinned, s3=s3, plan=plan
    )


def _on_s3(workdir: Path, server: LocalS3, store: str, table: pd.DataFrame) -> SimpleNamespace:
    from raytrain_tasks.storage.filesystem import StorageOptions
    from raytrain_tasks.storage.locations import create_bucket_in_region, locate, s3_client

    options = StorageOptions(endpoint_url=server.endpoint_url)
    create_bucket_in_region(s3_client(options), "prt-scoring-e2e")
    source = locate("s3://prt-scoring-e2e/tables/today.parquet", options)
    with source.filesystem.open_output_stream(source.path) as stream:
        table.to_parquet(stream)
    result = scoring_pipeline(
        model="models:/kinds@champion",
        input_path=source.uri,
        output_path="s3://prt-scoring-e2e/predictions/today.parquet",
        s3_endpoint_url=server.endpoint_url,
        mlflow_tracking_uri=store,
        concurrency=1,
    )
    output = locate("s3://prt-scoring-e2e/predictions/today.parquet", options)
    with output.filesystem.open_input_file(output.path) as stream:
        written = pq.read_table(stream).to_pandas()
    return SimpleNamespace(result=result, written=written)


def test_every_row_is_scored_once_by_the_champion_with_its_key(scored: SimpleNamespace) -> None:
    written = pd.read_parquet(scored.workdir / "out.parquet").sort_values("id")
    assert scored.first.rows == ROWS and not scored.first.already_written
    assert written["id"].tolist() == scored.table["id"].tolist()  # each key once, none missing
    expected = _expected(scored.store, "models:/churn/2", scored.table, list("abcd"))[:, 0]
    assert np.allclose(written["prediction"].to_numpy(), expected, atol=1e-6)
    assert (scored.first.model, scored.first.version) == ("churn", "2")
    assert sorted(path.name for path in scored.workdir.iterdir() if path.name.startswith("_")) == []  # no staging


def test_mlflow_records_which_version_scored_which_input_and_how_many_rows(scored: SimpleNamespace) -> None:
    client = MlflowClient(scored.store)
    run = client.get_run(scored.first.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["rows"] == ROWS
    assert run.data.tags[VERSION_TAG] == "2" and run.data.tags[INPUT_HASH_TAG] == scored.first.input_sha256
    assert run.data.params["model"] == "models:/churn@champion" and run.data.params["model_version"] == "2"
    assert run.data.params["input_files"] == "3"


def test_a_rerun_of_the_same_work_finds_it_written_and_writes_nothing(scored: SimpleNamespace) -> None:
    assert scored.again.already_written and scored.again.rows == ROWS
    assert scored.again.mlflow_run_id == scored.first.mlflow_run_id  # the run that wrote it, no second record
    experiment = MlflowClient(scored.store).get_experiment_by_name("prefect-raytrain-scoring")
    runs = MlflowClient(scored.store).search_runs([experiment.experiment_id])
    assert len(runs) == 3  # the first run, the pinned one, the S3 one


def test_a_promotion_after_the_run_resolved_the_alias_changes_nothing_in_its_output(scored: SimpleNamespace) -> None:
    written = pd.read_parquet(scored.workdir / "pinned.parquet").sort_values("id")
    assert scored.pinned.version == "2" and scored.plan.model.version == "2"
    expected = _expected(scored.store, "models:/churn/2", scored.table, list("abcd"))[:, 0]
    assert np.allclose(written["prediction"].to_numpy(), expected, atol=1e-6)


def test_an_s3_table_is_scored_into_s3_with_class_labels_from_the_models_metadata(scored: SimpleNamespace) -> None:
    written = scored.s3.written.sort_values("id")
    assert scored.s3.result.rows == ROWS and written["id"].tolist() == scored.table["id"].tolist()
    logits = _expected(scored.store, "models:/kinds/1", scored.table, ["b", "d"])
    assert written["prediction"].tolist() == [("cat", "dog")[i] for i in logits.argmax(axis=1)]
    assert np.allclose(np.stack(written["output"].to_numpy()), logits, atol=1e-6)


def test_the_command_refuses_a_model_that_does_not_exist_before_scoring(scored: SimpleNamespace) -> None:
    output = scored.workdir / "never.parquet"
    done = _command(scored, "--model", "models:/churn@canary", "--output", str(output))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "no such registered model version" in done.stderr and "check `model`" in done.stderr
    assert done.stderr.count("check `model`") == 1  # said once
    assert "Traceback" not in done.stderr and not output.exists()
    assert "models:/churn@canary" in done.stderr  # the model named as given
    assert "run the same command again" not in done.stderr  # a refusal fails the same way again


def _command(scored: SimpleNamespace, *flags: str) -> subprocess.CompletedProcess[str]:
    from prefect.settings import PREFECT_API_URL

    command = [sys.executable, "-m", "flows.command", "score", "--input", str(scored.workdir / "in")]
    command += ["--mlflow-tracking-uri", scored.store, *flags]
    env = {**CLIENT_ENV, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


@pytest.mark.chaos
def test_a_scoring_command_killed_midway_leaves_no_output_and_its_rerun_writes_each_row_once(
    tmp_path: Path,
) -> None:
    """SIGKILL to `prefect-raytrain score` (its own Ray) while its actors predict: no output file appears; the same
    command again writes every row once."""
    store = f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}"
    register_pt2(store, "big", width=4, outputs=1)
    table = _table(400_000)
    (tmp_path / "in").mkdir()
    for index, start in enumerate(range(0, len(table), len(table) // 8)):
        table[start : start + len(table) // 8].to_parquet(tmp_path / "in" / f"part-{index}.parquet")
    output = tmp_path / "out.parquet"
    command = [sys.executable, "-m", "flows.command", "score", "--model", "models:/big@champion"]
    command += ["--input", str(tmp_path / "in"), "--output", str(output), "--mlflow-tracking-uri", store]
    command += ["--batch-size", "256"]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own temporary Prefect API
    env.update(PYTHONPATH=str(REPO_ROOT))
    killed = subprocess.Popen(command, cwd=tmp_path, env=env)
    wait_for(lambda: list(tmp_path.glob("_staging-*/*.parquet")), 180, "the first staged part")
    killed_attempt = {path.name for path in tmp_path.glob("_staging-*")}
    killed.send_signal(signal.SIGKILL)  # its Ray ends with it (Ray's fate-sharing)
    killed.wait(timeout=30)
    time.sleep(1)
    assert not output.exists()
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    written = pq.read_table(output).to_pandas()
    assert len(written) == len(table) and written["id"].is_unique
    # The killed attempt's folder stays a day (a live concurrent attempt's looks the same); the rerun's is gone.
    (left,) = tmp_path.glob("_staging-*")
    assert left.name in killed_attempt and not (left / "_output.parquet").exists()
