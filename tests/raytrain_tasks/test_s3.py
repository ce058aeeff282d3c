"""Storage on S3, against a real S3-compatible server on 127.0.0.1 (SeaweedFS): real HTTP, real multipart."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlflow import MlflowClient

from devtools.s3_server import ADMIN, READER, LocalS3
from flows.training import PipelineResult, training_pipeline
from raytrain_tasks.config import parameters_of
from raytrain_tasks.errors import StorageError
from raytrain_tasks.storage.filesystem import StorageOptions
from raytrain_tasks.storage.locations import s3_client
from tests.helpers import prepared_for, small_config, table_dataset

BUCKET = "prt-tests"


def s3_config(workdir: Path, server: LocalS3, prefix: str, **overrides: Any) -> Any:
    values = {"storage_path": f"s3://{BUCKET}/{prefix}", "s3_endpoint_url": server.endpoint_url, "create_bucket": True}
    return small_config(workdir, **{**values, **overrides})


def admin_client(server: LocalS3) -> Any:
    return s3_client(StorageOptions(endpoint_url=server.endpoint_url))


def list_buckets(server: LocalS3) -> list[str]:
    return [bucket["Name"] for bucket in admin_client(server).list_buckets().get("Buckets", [])]


def list_keys(server: LocalS3, prefix: str) -> list[str]:
    client = admin_client(server)
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys += [item["Key"] for item in page.get("Contents", [])]
    return keys


@pytest.fixture(scope="module")
def s3_run(
    s3_server: LocalS3, tmp_path_factory: pytest.TempPathFactory, ray_cluster: object, prefect_api: None
) -> tuple[PipelineResult, Path]:
    workdir = tmp_path_factory.mktemp("s3-run")
    return training_pipeline(**parameters_of(s3_config(workdir, s3_server, "e2e", model_name="s3-model"))), workdir


@pytest.mark.slow
def test_everything_lands_in_the_bucket(s3_run: tuple[PipelineResult, Path], s3_server: LocalS3) -> None:
    result, workdir = s3_run
    keys = list_keys(s3_server, "e2e/")
    dataset_prefix = f"e2e/datasets/{result.dataset.content_hash}/"
    stored = {key.rsplit("/", 1)[1] for key in keys if key.startswith(dataset_prefix)}  # what prepare wrote
    assert {"train.parquet", "val.parquet", "dataset.json"} <= stored
    run_prefix = f"e2e/runs/{result.run_key}/"
    kept = sorted({key[len(run_prefix) :].split("/")[0] for key in keys if key.startswith(f"{run_prefix}epoch-")})
    assert kept == ["epoch-0002", "epoch-0003"]
    for name in kept:
        assert f"{run_prefix}{name}/spec_state.pt" in keys  # the table classifier's (a TrainSpec's) checkpoint
    assert any(key.startswith("e2e/mlartifacts/") and key.endswith("/MLmodel") for key in keys)
    assert any(key.endswith("evaluation/learning_curves.png") for key in keys)
    assert result.fit.best_checkpoint_uri.startswith(f"s3://{BUCKET}/e2e/runs/")
    assert not (workdir / "storage").exists()  # nothing fell back to local disk


@pytest.mark.slow
def test_champion_loads_from_s3_and_reproduces_accuracy(s3_run: tuple[PipelineResult, Path]) -> None:
    import mlflow

    from raytrain_tasks.table_classifier.data import read_split

    result, _ = s3_run
    assert result.model is not None
    mlflow.set_tracking_uri(result.config.mlflow_tracking_uri)
    model = mlflow.pyfunc.load_model("models:/s3-model@champion")
    table = table_dataset(result.dataset, result.config.storage_options)
    x_val, y_val = read_split(table, "test", result.config.storage_options, standardised=False)
    accuracy = float((np.asarray(model.predict(x_val)).argmax(axis=1) == y_val).mean())
    assert accuracy == pytest.approx(result.model.score, abs=1e-9)
    assert result.model.score >= 0.9


@pytest.mark.slow
def test_no_secret_reaches_params_tags_artifacts_or_logs(s3_run: tuple[PipelineResult, Path], tmp_path: Path) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter

    result, _ = s3_run
    secret = ADMIN[1]
    client = MlflowClient(result.config.mlflow_tracking_uri)
    run = client.get_run(result.fit.mlflow_run_id)
    exposed = json.dumps([run.data.params, run.data.tags, result.model_dump(mode="json")])
    for name in ("dataset_summary.json", "per_class_report.json", "checkpoint.json"):
        exposed += Path(client.download_artifacts(run.info.run_id, f"evaluation/{name}", str(tmp_path))).read_text()
    with get_client(sync_client=True) as prefect:
        exposed += " ".join(log.message for log in prefect.read_logs(log_filter=LogFilter()))
    assert secret not in exposed
    assert result.config.s3_endpoint_url in run.data.params["s3_endpoint_url"]  # the endpoint is no secret


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no-bucket", "bucket 'prt-missing' does not exist.*`create_bucket`"),
        ("bad-credentials", "rejected the credentials|access denied.*AWS_ACCESS_KEY_ID"),
        ("no-permission", "access denied on s3://prt-tests/readonly.*PutObject"),
        ("unreachable", "cannot reach s3://prt-tests.*`s3_endpoint_url`"),
    ],
    ids=lambda value: value if value in ("no-bucket", "bad-credentials", "no-permission", "unreachable") else "",
)
def test_preflight_fails_fast_naming_the_setting(
    case: str, expected: str, s3_server: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if BUCKET not in list_buckets(s3_server):
        admin_client(s3_server).create_bucket(Bucket=BUCKET)
    overrides: dict[str, Any] = {}
    storage = f"s3://{BUCKET}/{case}"
    if case == "no-bucket":
        storage, overrides["create_bucket"] = "s3://prt-missing/data", False
    elif case == "bad-credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    elif case == "no-permission":
        storage = f"s3://{BUCKET}/readonly"
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", READER[0])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READER[1])
    elif case == "unreachable":
        overrides["s3_endpoint_url"] = f"http://127.0.0.1:{_closed_port()}"
    config = s3_config(tmp_path, s3_server, "unused", storage_path=storage, **overrides)
    with pytest.raises(StorageError, match=expected) as info:  # how fast: `python -m bench.waits`
        prepared_for(config)  # prepare-data: storage is checked before the code loads anything
    assert "not-the-secret" not in str(info.value) and READER[1] not in str(info.value)
    if case == "no-bucket":
        assert "prt-missing" not in list_buckets(s3_server)  # nothing was created behind the user's back


@pytest.mark.slow
def test_the_s3_filesystem_keeps_its_retries_when_ray_pickles_it() -> None:
    """Ray Train pickles the storage filesystem to its controller and workers; pyarrow's own pickling drops the
    retry strategy, so uploads there would get 3 tries over about 2 s. Against an endpoint that hangs up on every
    connection, the unpickled copy must still make all its attempts, and say which request failed."""
    import pickle
    import threading

    from raytrain_tasks.storage.filesystem import RetryingS3FileSystem, open_filesystem

    # Counting connections, not seconds: AWS's backoff has full jitter, so 5 tries can take less time than 3.
    endpoint = socket.create_server(("127.0.0.1", 0))
    attempts = []

    def hang_up() -> None:
        while True:
            try:
                connection, _ = endpoint.accept()
            except OSError:  # closed at the end of the test
                return
            attempts.append(time.monotonic())
            connection.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        options = StorageOptions(endpoint_url=f"http://127.0.0.1:{endpoint.getsockname()[1]}", max_attempts=5)
        filesystem, path = open_filesystem(f"s3://{BUCKET}/x", options)
        copy = pickle.loads(pickle.dumps(filesystem))
        assert isinstance(copy, RetryingS3FileSystem) and copy.max_attempts == 5
        with pytest.raises(OSError, match=f"bucket '{BUCKET}'.*NETWORK_CONNECTION during HeadObject"):
            copy.get_file_info(f"{path}/probe")
    finally:
        endpoint.close()
    assert len(attempts) == 5  # pyarrow's unpickled default: 3


@pytest.mark.parametrize("attempts", [1, 4])
def test_the_s3_client_tries_each_request_s3_max_attempts_times(attempts: int) -> None:
    """boto3 was fixed at 2 tries whatever `s3_max_attempts` said; counted here on an endpoint nobody serves."""
    from botocore.exceptions import EndpointConnectionError

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = s3_client(StorageOptions(endpoint_url=f"http://127.0.0.1:{port}", max_attempts=attempts))
    sent: list[str] = []
    client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
    with pytest.raises(EndpointConnectionError):
        client.head_bucket(Bucket="prt-attempts")
    assert len(sent) == attempts


def test_create_bucket_names_the_region_outside_us_east_1(s3_server: LocalS3) -> None:
    """`create_bucket` with `s3_region`: AWS refuses a CreateBucket outside us-east-1 without a LocationConstraint
    (the request is read as it leaves the client; the local server accepts either)."""
    from raytrain_tasks.storage.locations import create_bucket_in_region

    bodies: dict[str, bytes] = {}
    for region in ("eu-west-1", "us-east-1"):
        client = s3_client(StorageOptions(endpoint_url=s3_server.endpoint_url, region=region))
        client.meta.events.register(
            "before-send.s3.CreateBucket", lambda request, region=region, **_: bodies.update({region: request.body})
        )
        create_bucket_in_region(client, f"prt-region-{region}")
        assert f"prt-region-{region}" in list_buckets(s3_server)
    assert b"<LocationConstraint>eu-west-1</LocationConstraint>" in (bodies["eu-west-1"] or b"")
    assert not bodies["us-east-1"]  # us-east-1 takes no constraint (AWS refuses one naming it)
