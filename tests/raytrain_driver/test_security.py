"""What storage holds is data, never code; what names a folder or a filter is checked first.

A writer of the checkpoint storage is the attacker here: it replaces a checkpoint file with a pickle that
creates a file when unpickled, and (where it can write the MLflow run too) records the new files' digest there.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from raytrain_tasks.api import TrainSpec
from raytrain_tasks.config import TrainingConfig, check_run_key, parameters_of
from raytrain_tasks.errors import UnsafeCheckpointError
from raytrain_tasks.trainspec.checkpoint import capture_rng_state, restore_rng_state
from raytrain_tasks.trainspec.loop import STATE_FILE
from tests.helpers import CreatesAFile


@pytest.mark.parametrize("how", ["torch.save", "plain pickle"])
def test_a_checkpoint_carrying_a_pickle_is_refused_and_never_runs(tmp_path: Path, how: str) -> None:
    """A TrainSpec's checkpoint is read with torch's restricted unpickler alone, on the workers (a resume) and on
    the driver (registration): an object that would run code when unpickled is refused before it is created."""
    from raytrain_tasks.table_classifier.spec import classifier
    from raytrain_tasks.trainspec.loop import spec_load_model

    folder = tmp_path / "epoch-0001"
    folder.mkdir()
    marker = tmp_path / "pwned"
    if how == "torch.save":
        torch.save({"model": CreatesAFile(marker)}, folder / STATE_FILE)
    else:
        (folder / STATE_FILE).write_bytes(pickle.dumps(CreatesAFile(marker)))
    assert isinstance(classifier, TrainSpec)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        spec_load_model(classifier)(folder, {})
    assert not marker.exists()


def test_rng_state_round_trips_without_any_pickled_object(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.random(), np.random.rand(), np.random.randn()  # a cached Gaussian is part of numpy's state
    torch.save({"rng": capture_rng_state()}, tmp_path / STATE_FILE)
    expected = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist())
    random.seed(99), np.random.seed(99), torch.manual_seed(99)

    # The file loads with the restricted unpickler alone.
    restore_rng_state(torch.load(tmp_path / STATE_FILE, weights_only=True)["rng"])
    assert (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist()) == expected


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

    from raytrain_driver.register import _version_of_run
    from raytrain_tasks.tracking.runs import find_run

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


# --- one finished run, tampered with by a writer of its storage ---------------------------------------------------


@dataclass(frozen=True)
class FinishedRun:
    workdir: Path  # the run's storage and its MLflow store (mlflow.db)
    config: TrainingConfig  # register=False, as the run was trained
    run_key: str
    mlflow_run_id: str
    mlflow_experiment_id: str
    run_dir: Path
    best: Path  # the best checkpoint's folder


def _copy_run(source: Path, target: Path) -> None:
    """A run's working folder (storage, MLflow store) from ``source`` into ``target``, where nothing of it is left
    but the MLflow database. That one is written with SQLite's own backup, page by page: connections MLflow keeps
    open on it (its engines are cached per URI for the process) then read the copy, not the unlinked file that a
    copy over it would leave them on."""
    for entry in source.iterdir():
        if entry.name == "mlflow.db":
            continue
        if entry.is_dir():
            shutil.copytree(entry, target / entry.name)
        else:
            shutil.copy2(entry, target / entry.name)
    with closing(sqlite3.connect(source / "mlflow.db")) as src, closing(sqlite3.connect(target / "mlflow.db")) as dst:
        src.backup(dst)


@pytest.fixture(scope="module")
def _trained_once(
    tmp_path_factory: pytest.TempPathFactory, ray_cluster: object, prefect_api: None
) -> tuple[FinishedRun, Path]:
    """One real fit of two epochs for every tampering test below, and a pristine copy of all it left."""
    from flows.training import training_pipeline
    from tests.helpers import small_config

    workdir = tmp_path_factory.mktemp("finished-run")
    config = small_config(workdir, epochs=2, register=False, num_workers=1)  # one worker: DDP is not the subject
    first = training_pipeline(**parameters_of(config))
    run = FinishedRun(
        workdir=workdir,
        config=config,
        run_key=first.run_key,
        mlflow_run_id=first.fit.mlflow_run_id,
        mlflow_experiment_id=first.fit.mlflow_experiment_id,
        run_dir=Path(first.fit.run_uri),
        best=Path(first.fit.best_checkpoint_uri),
    )
    pristine = tmp_path_factory.mktemp("finished-run-pristine")
    _copy_run(workdir, pristine)
    return run, pristine


@pytest.fixture
def finished_run(_trained_once: tuple[FinishedRun, Path]) -> FinishedRun:
    """The shared run as its fit left it, whatever the test before tampered with: each test gets its own copy, at
    the run's own paths (Ray Train's snapshot and the MLflow run's params name them; a resume elsewhere would
    be refused or read the original)."""
    run, pristine = _trained_once
    for entry in run.workdir.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        elif entry.name != "mlflow.db":
            entry.unlink()
    _copy_run(pristine, run.workdir)
    return run


@pytest.mark.slow
def test_registration_refuses_a_tampered_best_checkpoint_and_registers_nothing(
    finished_run: FinishedRun, tmp_path: Path
) -> None:
    """The driver loads only the weights of the best checkpoint; a pickle there is refused before anything is
    logged or registered, and the code in it never runs. The attacker here can write storage *and* the MLflow
    run (it records the new files' digest), so the digest check passes and the loader itself must refuse."""
    from mlflow import MlflowClient

    from flows.training import training_pipeline
    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.tracking.names import pin_tag

    config, best = finished_run.config, finished_run.best
    marker = tmp_path / "pwned"
    torch.save({"model": CreatesAFile(marker)}, best / STATE_FILE)
    client = MlflowClient(config.mlflow_tracking_uri)
    client.set_tag(finished_run.mlflow_run_id, pin_tag(best.name), local_folder_digest(best))

    resumed = config.model_copy(update={"resume": finished_run.run_key, "register": True})
    state = training_pipeline(**parameters_of(resumed), return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert "Weights only load failed" in str(error), error
    assert not marker.exists()
    client = MlflowClient(config.mlflow_tracking_uri)
    assert client.search_registered_models() == []
    # Only the first fit's checkpoint LoggedModels: no model was logged for registration.
    logged = client.search_logged_models([finished_run.mlflow_experiment_id])
    assert [m.name for m in logged if m.model_type != "checkpoint"] == [] and logged


@pytest.mark.slow
def test_storage_cannot_vouch_for_itself_a_replaced_record_or_checkpoint_is_refused(
    finished_run: FinishedRun,
) -> None:
    """fit.json (it carries the scores the promotion gate compares) and the best checkpoint are trusted only while
    they hash to what the MLflow run recorded when they were written."""
    from mlflow import MlflowClient

    from flows.training import training_pipeline
    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.tracking.names import pinned_digests

    config, run_dir, best = finished_run.config, finished_run.run_dir, finished_run.best
    client = MlflowClient(config.mlflow_tracking_uri)
    pinned = pinned_digests(client.get_run(finished_run.mlflow_run_id).data.tags)
    on_disk = {p.name: local_folder_digest(p) for p in run_dir.glob("epoch-*")}
    assert on_disk and pinned == on_disk  # every kept checkpoint is vouched for, by the digest it has

    resumed = config.model_copy(update={"resume": finished_run.run_key, "register": True})
    record = run_dir / "fit.json"
    original = record.read_text()
    record.write_text(original.replace('"test_accuracy": 0.', '"test_accuracy": 1.0, "x": 0.', 1))
    state = training_pipeline(**parameters_of(resumed), return_state=True)
    error = state.result(raise_on_failure=False)
    assert state.is_failed() and isinstance(error, UnsafeCheckpointError) and "fit.json" in str(error), error

    record.write_text(original)
    other = torch.load(best / STATE_FILE, weights_only=True)
    other["model"] = {key: value + 1.0 for key, value in other["model"].items()}  # other weights, the real format
    torch.save(other, best / STATE_FILE)
    state = training_pipeline(**parameters_of(resumed), return_state=True)
    error = state.result(raise_on_failure=False)
    assert state.is_failed() and isinstance(error, UnsafeCheckpointError), error
    assert f"is not the one run {finished_run.run_key} committed" in str(error) and best.name in str(error)
    assert client.search_registered_models() == []


@pytest.mark.slow
def test_a_folder_the_snapshot_points_at_is_checked_whatever_its_name(finished_run: FinishedRun) -> None:
    """Whoever can write storage copies an older checkpoint to a folder not named `epoch-*` and points Ray Train's
    checkpoint snapshot at it. The resume refuses the snapshot before any worker starts (test_ray_record checks
    every entry), rather than trusting the folder as one this fit's own workers committed."""
    from mlflow import MlflowClient

    from flows.training import training_pipeline

    config, run_dir = finished_run.config, finished_run.run_dir
    shutil.copytree(run_dir / "epoch-0001", run_dir / "planted-0002")  # a real checkpoint, of the first epoch
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    assert "epoch-0002" in snapshot.read_text()
    snapshot.write_text(snapshot.read_text().replace("epoch-0002", "planted-0002"))
    (run_dir / "fit.json").unlink()  # as a driver killed between the last epoch and its record leaves the run

    resumed = config.model_copy(update={"resume": finished_run.run_key})
    state = training_pipeline(**parameters_of(resumed), return_state=True)
    error = state.result(raise_on_failure=False)
    assert state.is_failed() and isinstance(error, UnsafeCheckpointError), error
    assert "planted-0002" in str(error) and "never writes" in str(error)
    # Nothing was trained: from the planted copy of epoch 1, epoch 2 would have been trained again, into
    # epoch-0002-r1.
    assert not (run_dir / "epoch-0002-r1").exists()
    history = MlflowClient(config.mlflow_tracking_uri).get_metric_history(finished_run.mlflow_run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [1, 2], history


# --- credentials against a real authentication-enabled MLflow server ------------------------------------------

ADMIN_PASSWORD = "prt-mlflow-admin-pw-7731"
WRONG_PASSWORD = "prt-wrong-pw-never-shown-4419"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server --app-name basic-auth` on a free port: every request needs a user and password."""

    from tests.helpers import free_port, start_mlflow_server, stop_process_group

    root = tmp_path_factory.mktemp("mlflow-auth")
    ini = root / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{root / 'auth.db'}\nadmin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    port = free_port()
    env = {
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "prt-test-only-flask-key",
    }
    server = start_mlflow_server(root, port, app_name="basic-auth", env=env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_process_group(server)


def run_cli(tmp_path: Path, args: list[str], env: dict[str, str]) -> tuple[int, str]:
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    from tests.helpers import REPO_ROOT, joins_this_ray

    base = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    base.update(joins_this_ray())  # the session's Ray: a local Ray's start is not the subject
    command = [sys.executable, "-m", "flows.training", "--storage-path", str(tmp_path / "storage"), *args]
    command += ["--epochs", "1", "--num-workers", "1", "--experiment-name", "auth", "--model-name", "auth-model"]
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**base, "PREFECT_API_URL": str(PREFECT_API_URL.value()), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode, done.stdout + done.stderr


def flow_run_texts(parameters_given_by_user: object) -> list[tuple[str, str]]:
    """(what, text) for everything Prefect holds about the recent flow runs: parameters, states, logs, artifacts;
    the parameters of the flow run ``parameters_given_by_user`` are left out: Prefect stores them as given."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    texts = []
    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=3)  # this test's three runs
        ids = [flow_run.id for flow_run in flow_runs]
        for flow_run in flow_runs:
            if flow_run.id != parameters_given_by_user:
                texts.append((f"flow run {flow_run.name} parameters", json.dumps(flow_run.parameters, default=str)))
            texts.append((f"flow run {flow_run.name} state", str(flow_run.state and flow_run.state.message)))
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
        texts += [(f"task run {t.name} state", str(t.state and t.state.message)) for t in task_runs]
        for flow_run_id in ids:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            texts += [(f"log of flow run {flow_run_id}", log.message) for log in logs]
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))
        texts += [(f"artifact {a.key}", str(a.data)) for a in artifacts]
    assert len(task_runs) >= 4 and any(what.startswith("log") for what, _ in texts)
    return texts


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_mlflow_credentials_appear_nowhere_the_product_writes(tmp_path: Path, auth_server: str) -> None:
    from mlflow import MlflowClient

    from flows.training import training_pipeline
    from raytrain_tasks.errors import TrackingError
    from tests.helpers import small_config

    # 1. Credentials in the URI, from the CLI: the run works, and the password is in no output or record. With
    # --verbose, which shows everything: the Ray processes' own output too.
    uri = f"http://admin:{ADMIN_PASSWORD}@{auth_server}"
    code, output = run_cli(tmp_path, ["--mlflow-tracking-uri", uri, "--verbose"], {})
    assert code == 0, output[-4000:]
    assert "(KeepResumedController pid=" in output  # Ray Train's controller (raytrain_driver.retention's door)
    assert "http://admin:***@" in output or f"http://{auth_server}" in output
    # 2. Credentials in the environment, wrong password: a clear error naming the settings, and no password.
    code, refused = run_cli(
        tmp_path,
        ["--mlflow-tracking-uri", f"http://{auth_server}"],
        {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": WRONG_PASSWORD},
    )
    assert code == 1 and "MLFLOW_TRACKING_PASSWORD" in refused, refused[-4000:]
    # 3. A wrong password in the URI of a flow started in-process (as from the Prefect UI's form).
    state = training_pipeline(
        **parameters_of(small_config(tmp_path, mlflow_tracking_uri=f"http://admin:{WRONG_PASSWORD}@{auth_server}")),
        return_state=True,
    )
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, TrackingError) and "credentials" in str(error) and WRONG_PASSWORD not in str(error)

    client = MlflowClient(f"http://admin:{ADMIN_PASSWORD}@{auth_server}")
    (run,) = client.search_runs([client.get_experiment_by_name("auth").experiment_id])
    assert run.info.status == "FINISHED"
    records = [
        ("stdout/stderr of the good run", output),
        ("stdout/stderr of the refused run", refused),
        ("MLflow params", json.dumps(run.data.params)),
        ("MLflow tags", json.dumps(run.data.tags)),
        ("model versions", json.dumps([dict(v) for v in map(vars, client.search_model_versions())], default=str)),
    ]
    records += flow_run_texts(parameters_given_by_user=state.state_details.flow_run_id)
    assert sum("parameters" in what for what, _ in records) >= 2  # the CLI's runs: it moved the password out
    assert run.data.params["mlflow_tracking_uri"] in (f"http://{auth_server}", f"http://admin:***@{auth_server}")
    for what, text in records:
        assert ADMIN_PASSWORD not in text, f"the MLflow password is in {what}"
        assert WRONG_PASSWORD not in text, f"the wrong MLflow password is in {what}"
    print(f"\nsearched {len(records)} records, {sum(len(t) for _, t in records)} characters, for both passwords:")
    for what in sorted({what.split(" of flow run")[0].split(" of task run")[0] for what, _ in records}):
        print(f"  {what}: none")


# --- the one redactor ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://bob:s3cr3t@mlflow:5000/api/2.0", "http://bob:***@mlflow:5000/api/2.0"),
        ("failed: https://u:p%40ss@h/x and s3://bucket/key", "failed: https://u:***@h/x and s3://bucket/key"),
        ("GET https://h/api?run=1&token=abc123def&x=2", "GET https://h/api?run=1&token=***&x=2"),
        ("https://b.s3/k?X-Amz-Signature=deadbeef99&X-Amz-Date=1", "https://b.s3/k?X-Amz-Signature=***&X-Amz-Date=1"),
        ("the key is env-secret-value-42, again env-secret-value-42", "the key is ***, again ***"),
        ("no url here", "no url here"),
    ],
)
def test_secrets_are_masked_in_any_text(text: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from raytrain_tasks.redact import redact

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "env-secret-value-42")
    assert redact(text) == expected


@pytest.mark.parametrize(
    ("variable", "text", "expected"),
    [
        ("RAY_AUTH_TOKEN", "ray token ray-token-value-77 in a log", "ray token *** in a log"),
        ("PREFECT_API_KEY", "Authorization: Bearer pnu_prefect-key-88", "Authorization: Bearer pnu_***"),
        ("", "http://bob:pa/ss-word-1@mlflow:5000/api", "http://bob:***@mlflow:5000/api"),
        ("", "s3://key:sec/ret/x@bucket/k", "s3://key:***@bucket/k"),
        ("", "'admin:pw-no-scheme-1@127.0.0.1:8333' is not a URL", "'admin:***@127.0.0.1:8333' is not a URL"),
        ("", "endpoint admin:pw/no-scheme@h:1 refused", "endpoint admin:***@h:1 refused"),
        ("", "http://h:5000/api at 10:30, git@github.com:o/r", "http://h:5000/api at 10:30, git@github.com:o/r"),
        # MLflow's model URIs name a model and its alias, not a password: an error must say which model.
        ("", "model models:/digits-classifier@champoin: no such", "model models:/digits-classifier@champoin: no such"),
        ("", "'models:/churn@champion' and bob:pw-no-scheme@h:1", "'models:/churn@champion' and bob:***@h:1"),
    ],
)  # fmt: skip
def test_more_secrets_are_masked(variable: str, text: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from raytrain_tasks.redact import redact

    if variable == "RAY_AUTH_TOKEN":
        monkeypatch.setenv(variable, "ray-token-value-77")
    if variable == "PREFECT_API_KEY":
        monkeypatch.setenv(variable, "prefect-key-88")
    assert redact(text) == expected


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("s3_endpoint_url", "admin:pw-no-scheme-2@127.0.0.1:8333"),
        ("s3_endpoint_url", "admin:pw/no-scheme-2@127.0.0.1:8333"),
        ("dataset", "admin:pw-no-scheme-2@host/data.txt"),
        ("epochs", "admin:pw-no-scheme-2@host"),
        ("storage_path", "gs://admin:pw-no-scheme-2@bucket/x"),
    ],
)
def test_a_rejected_setting_is_not_echoed_with_its_password(setting: str, value: str) -> None:
    with pytest.raises(ValidationError) as refused:
        TrainingConfig(**{setting: value})
    text = str(refused.value)
    assert setting in text and "no-scheme-2" not in text, text


def test_an_exception_leaving_a_task_keeps_its_type_and_loses_its_secrets() -> None:
    from mlflow.exceptions import MlflowException

    from raytrain_tasks.redact import redacted_errors

    cause = ConnectionError("HTTPConnectionPool: http://admin:hunter2hunter2@127.0.0.1:5000/api failed")
    with pytest.raises(MlflowException) as raised, redacted_errors():
        try:
            raise cause
        except ConnectionError as exc:
            raise MlflowException("API request to http://admin:hunter2hunter2@127.0.0.1:5000/api failed") from exc
    assert "hunter2hunter2" not in str(raised.value) and "admin:***@" in str(raised.value)
    assert "hunter2hunter2" not in str(raised.value.__cause__)
    assert raised.value.__cause__ is cause  # the same objects: handlers and retry conditions see no difference


def test_log_records_and_their_tracebacks_are_masked_before_any_handler(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from raytrain_tasks.redact import RedactingFilter

    logger = logging.getLogger("prt-redaction-test")
    caplog.handler.addFilter(RedactingFilter())
    try:
        raise RuntimeError("request to https://u:topsecret99@h/x failed")
    except RuntimeError:
        logger.exception("talking to %s", "https://u:topsecret99@h/x")
    (record,) = caplog.records
    assert "topsecret99" not in caplog.text and "u:***@h" in caplog.text
    assert record.exc_text and "topsecret99" not in record.exc_text


def test_the_cli_moves_uri_credentials_into_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from flows.cli import credentials_to_environment

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    config = credentials_to_environment(TrainingConfig(mlflow_tracking_uri="http://ann:pw-in-uri-1@127.0.0.1:5000/x"))
    assert config.mlflow_tracking_uri == "http://127.0.0.1:5000/x"
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("ann", "pw-in-uri-1")
    assert "pw-in-uri-1" not in json.dumps(config.public_params(secret_keys=()))


# --- the champion is loaded only in the exact layout this project writes, with pickles switched off ----------------


@pytest.mark.usefixtures("prefect_api")
def test_a_pickle_placed_beside_the_champions_pt2_never_runs_and_nothing_moves(tmp_path: Path) -> None:
    """Whoever can write the registry's artifact store adds a pickled ``data/model.pth`` (and the
    ``pickle_module_info.txt`` MLflow reads with it) beside a real champion's ``model.pt2``. Scoring that champion
    must not unpickle it: the champion is refused with the reason, no alias moves, the code never runs."""
    from urllib.parse import urlparse

    from mlflow import MlflowClient

    from raytrain_tasks.errors import PromotionError
    from tests.helpers import REGISTRY_CODE, fit_for_registry, register_for_test, small_config

    config = small_config(tmp_path, train_code=REGISTRY_CODE, model_name="planted", experiment_name="planted")
    dataset = None
    client = MlflowClient(config.mlflow_tracking_uri)
    champion = register_for_test(
        config, dataset, fit_for_registry(client, tmp_path, config, dataset, "20261125-010000-aaaaaa", 0.5)
    )
    assert champion.decision == "promote"
    # The version's artifacts, in the store beside the SQLite database (a file: URI).
    model_dir = Path(urlparse(client.get_model_version_download_uri("planted", champion.version)).path)
    assert sorted(p.name for p in (model_dir / "data").iterdir()) == ["model.pt2"]  # what MLflow's pt2 writes
    marker = tmp_path / "pwned"
    (model_dir / "data" / "model.pth").write_bytes(pickle.dumps(CreatesAFile(marker)))
    (model_dir / "data" / "pickle_module_info.txt").write_text("pickle")

    fit = fit_for_registry(client, tmp_path, config, dataset, "20261125-020000-bbbbbb", 0.99)
    error = register_for_test(config, dataset, fit)
    assert not marker.exists()
    assert isinstance(error, PromotionError) and "No alias moved" in str(error), error
    assert "data/model.pth" in str(error) and f"version {champion.version}" in str(error), error
    aliases = client.get_registered_model("planted").aliases
    assert str(aliases["champion"]) == champion.version and "previous_champion" not in aliases
