"""`prefect-raytrain`, the console script pyproject installs: its subcommands as a user runs them.

`runs` and `resume` after a killed and a finished run are in test_recovery.py
(test_cli_killed_then_resumed_continues_the_same_run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.cli import parse_config
from flows.command import flags_from_params
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.environment import PREFECT_CONFIGURED_BY, embedded_prefect_home
from tests.helpers import free_port, mlflow_client, stop_process_group

PREFECT_RAYTRAIN = str(Path(sys.executable).with_name("prefect-raytrain"))


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    return subprocess.run([PREFECT_RAYTRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_settings_a_run_logged_rebuild_the_same_config() -> None:
    """`resume` rebuilds the run's config from its MLflow params: every kind of field comes back the same. The
    run logs the table classifier's settings in its train_config, which is what it rebuilds."""
    config = TrainingConfig(
        train_config={"dataset": "synthetic", "hidden_sizes": [32, 16], "data_loader": "ray_data"},
        use_gpu=False,
        register=False,
        learning_rate=0.0025,
        storage_path="/data/prt",
        mlflow_tracking_uri="sqlite:////data/mlflow.db",
    )
    assert config.train_config["data_loader"] == "ray_data"
    params = {key: str(value) for key, value in config.public_params(secret_keys=()).items()}
    assert parse_config(flags_from_params(params, [])) == config


def test_a_run_of_the_built_in_classifier_of_earlier_releases_is_refused_saying_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run of releases up to 0.2 (train_code '') cannot be resumed: its code is gone. The refusal names the
    setting and what trains the same model now, before anything starts."""
    params = {key: str(value) for key, value in TrainingConfig().public_params(secret_keys=()).items()}
    params["train_code"] = ""
    with pytest.raises(SystemExit) as refused:
        parse_config(flags_from_params(params, []))
    said = capsys.readouterr().err
    assert refused.value.code == 2 and "train_code '' (the built-in classifier of releases up to 0.2) is gone" in said
    assert "raytrain_tasks.table_classifier:classifier" in said and "cannot be resumed" in said, said


def test_a_masked_setting_must_be_given_again() -> None:
    params = {key: str(value) for key, value in TrainingConfig().public_params(secret_keys=()).items()}
    params["mlflow_tracking_uri"] = "http://user:***@mlflow.example:5000"
    try:
        flags_from_params(params, [])
    except SystemExit as exc:
        assert "mlflow_tracking_uri was logged masked" in str(exc) and "--mlflow-tracking-uri" in str(exc)
    else:
        raise AssertionError("a masked value was used as it is")
    given = ["--mlflow-tracking-uri=http://mlflow.example:5000"]
    assert not any(flag.startswith("--mlflow-tracking-uri") for flag in flags_from_params(params, given))


def test_the_embedded_defaults_keep_prefects_state_under_pipeline_unless_prefect_is_set_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer's `prefect-raytrain train` (no Prefect set up) left Prefect's database and the pin journals in
    ~/.prefect, though the README says the embedded defaults keep every piece of state under ./.pipeline."""
    for name in PREFECT_CONFIGURED_BY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)

    def home_set_by_the_command() -> str | None:
        embedded_prefect_home(".pipeline")
        home = os.environ.get("PREFECT_HOME")
        monkeypatch.delenv("PREFECT_HOME", raising=False)
        return home

    assert home_set_by_the_command() == str(tmp_path / ".pipeline" / "prefect")
    assert (tmp_path / ".pipeline" / "prefect").is_dir()
    # Prefect set up by the user, each way Prefect itself reads it: left to Prefect.
    profiles = tmp_path / "home" / ".prefect" / "profiles.toml"  # `prefect config set` wrote one
    profiles.parent.mkdir(parents=True)
    profiles.write_text('active = "default"\n')
    assert home_set_by_the_command() is None
    profiles.unlink()
    for file, text in (("prefect.toml", "[api]\n"), (".env", "PREFECT_HOME=/srv/prefect\n")):
        (tmp_path / file).write_text(text)
        assert home_set_by_the_command() is None, file
        (tmp_path / file).unlink()
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "mine"\n')  # no Prefect settings in it
    assert home_set_by_the_command() == str(tmp_path / ".pipeline" / "prefect")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")  # a server of the user's
    assert home_set_by_the_command() is None


@pytest.mark.slow
def test_runs_on_an_empty_store_and_unknown_commands(tmp_path: Path) -> None:
    listing = _run("runs", cwd=tmp_path)
    assert listing.returncode == 0 and "no runs in experiment 'prefect-raytrain'" in listing.stdout
    assert str(tmp_path / ".pipeline" / "mlflow.db") in listing.stdout  # train's default store, in this folder
    missing = _run("resume", "20261123-120000-abcdef", cwd=tmp_path)
    assert missing.returncode == 2 and "no run with run key 20261123-120000-abcdef" in missing.stderr
    unknown = _run("fit", cwd=tmp_path)
    assert unknown.returncode == 2 and "one of: train, runs, resume, ui" in unknown.stderr
    helped = _run("train", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "--num-workers" in helped.stdout and "prefect-raytrain train" in helped.stdout
    invalid = _run("train", "--num-workers", "0", cwd=tmp_path)
    assert invalid.returncode == 2 and "num_workers" in invalid.stderr


@pytest.mark.slow
def test_ui_serves_the_mlflow_ui_over_the_local_store(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(store).create_experiment("seen-in-the-ui", artifact_location=str(tmp_path / "artifacts"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    ui = subprocess.Popen(
        [PREFECT_RAYTRAIN, "ui", "--mlflow-tracking-uri", store, "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name?experiment_name=seen-in-the-ui"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert ui.poll() is None, ui.communicate()[0]
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    experiment = json.load(reply)["experiment"]
                break
            except OSError:
                assert time.monotonic() < deadline, "the MLflow UI never answered"
                time.sleep(0.5)
        assert experiment["name"] == "seen-in-the-ui"
    finally:
        stop_process_group(ui)
    assert f"MLflow UI: http://127.0.0.1:{port}" in ui.communicate()[0]


def test_runs_says_what_each_run_trains(tmp_path: Path) -> None:
    """With several models in one experiment, `runs` tells them apart: the user's train_code, or the built-in
    classifier and its dataset."""
    from flows.command import describe_run
    from raytrain_tasks.tracking import runs as tracking
    from tests.helpers import seed_mlflow_store

    seed_mlflow_store(tmp_path / "mlflow.db")
    client = mlflow_client(tmp_path)
    experiment = client.create_experiment("runs", artifact_location=str(tmp_path / "artifacts"))
    shown = {}
    for key, params in (
        ("20261127-040000-aaaaaa", {"train_code": "my_images.train:training", "epochs": "3"}),
        ("20261127-040000-bbbbbb", {"model": "mlp", "dataset": "digits", "epochs": "3"}),
    ):
        run = client.create_run(experiment, tags={tracking.RUN_KEY_TAG: key})
        for name, value in params.items():
            client.log_param(run.info.run_id, name, value)
        shown[key] = describe_run(client, client.get_run(run.info.run_id))["trains"]
    assert shown == {"20261127-040000-aaaaaa": "my_images.train:training", "20261127-040000-bbbbbb": "mlp on digits"}


def test_runs_calls_a_stopped_run_with_no_checkpoint_resumable_from_its_first_epoch(tmp_path: Path) -> None:
    """`resume` continues a run that stopped before its first checkpoint (from epoch 1, in the same MLflow run), as
    the failure's own message says: `runs` must not tell the user to start again."""
    from flows.command import describe_run
    from raytrain_tasks.tracking import runs as tracking
    from tests.helpers import seed_mlflow_store

    seed_mlflow_store(tmp_path / "mlflow.db")
    client = mlflow_client(tmp_path)
    experiment = client.create_experiment("runs", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment, tags={tracking.RUN_KEY_TAG: "20261127-040000-cccccc"})
    client.log_param(run.info.run_id, "epochs", "3")
    client.set_terminated(run.info.run_id, "FAILED")
    shown = describe_run(client, client.get_run(run.info.run_id))
    assert (shown["state"], shown["epochs"], shown["resumable"]) == ("failed", "0/3", "yes (from epoch 1)")
    # A run that failed on an error of the user's code: `resume` helps only once the code is fixed (its error says
    # so, and that a train_config value at fault needs a new run instead).
    client.set_tag(run.info.run_id, tracking.ERROR_TAG, "UserCodeError: train_code 'my.code:training' failed")
    shown = describe_run(client, client.get_run(run.info.run_id))
    assert (shown["state"], shown["resumable"]) == ("failed", "after a code fix")


def _trained_run(client: MlflowClient, experiment: str, key: str, status: str, register: str) -> str:
    """An MLflow run as a fit of one epoch leaves it: its settings, its epoch, its fit record's digest."""
    from raytrain_tasks.tracking import runs as tracking

    run_id = client.create_run(experiment, tags={tracking.RUN_KEY_TAG: key}).info.run_id
    for name, value in {"epochs": "1", "register": register, "model_name": "listed"}.items():
        client.log_param(run_id, name, value)
    client.log_metric(run_id, "val_accuracy", 0.9, step=1)
    client.set_tag(run_id, tracking.FIT_RECORD_TAG, "0" * 64)
    client.set_terminated(run_id, status)
    return run_id


# What register-model leaves on the run key's version (raytrain_driver/register.py).
UNDECIDED = {"promotion.decision": "undecided", "promotion.reason": "champion version 1 failed to load"}
APPLIED = {"promotion.decision": "promote", "promotion.reason": "no champion yet", "promotion.applied": "true"}
NOT_A_NUMBER = {
    "promotion.decision": "undecided",
    "promotion.reason": "this run's score is nan, not a number the gate can compare: no alias moves",
}


@pytest.mark.parametrize(
    ("status", "register", "version", "listed"),
    [
        # register-model failed before it registered a version (the registry unreachable), or was SIGKILLed: the
        # fit had marked the run FINISHED.
        ("FINISHED", "True", None, ("waiting for registration", "1/1", "yes")),
        # A version registered, its decision not applied (the champion could not be assessed; killed before the
        # aliases moved).
        ("FINISHED", "True", UNDECIDED, ("waiting for registration", "1/1", "yes")),
        # Stopped during register-model (SIGTERM, Ctrl-C): it marks the run KILLED.
        ("KILLED", "True", None, ("waiting for registration", "1/1", "yes")),
        # Its model being logged (MLflow's start_run sets the run RUNNING) when the process died.
        ("RUNNING", "True", None, ("waiting for registration", "1/1", "yes")),
        ("FINISHED", "True", APPLIED, ("finished", "1/1", "-")),
        # register=False: nothing to wait for, unless a resume turned it on and registered a version.
        ("FINISHED", "False", None, ("finished", "1/1", "-")),
        ("FINISHED", "False", UNDECIDED, ("waiting for registration", "1/1", "yes")),
        # A score the gate cannot compare: a resume reads the same score, so it cannot finish the registration.
        ("FINISHED", "True", NOT_A_NUMBER, ("not registered", "1/1", "no (score not comparable)")),
    ],
)
def test_runs_shows_a_trained_run_whose_registration_was_not_applied_as_waiting_for_it(
    tmp_path: Path, status: str, register: str, version: dict[str, str] | None, listed: tuple[str, str, str]
) -> None:
    """A run whose register-model failed or was killed after its fit finished: `resume` trains nothing and
    registers it (raytrain_driver/fit.py's finished fit), so `runs` must not call it finished."""
    from flows.command import describe_run
    from raytrain_tasks.tracking import run_owner
    from tests.helpers import seed_mlflow_store

    seed_mlflow_store(tmp_path / "mlflow.db")
    client = mlflow_client(tmp_path)
    experiment = client.create_experiment("runs", artifact_location=str(tmp_path / "artifacts"))
    key = "20261127-050000-dddddd"
    run_id = _trained_run(client, experiment, key, status, register)
    if status == "RUNNING":  # its driver, this process under another start time: gone
        client.set_tag(run_id, run_owner.DRIVER_TAG, run_owner.this_driver().rsplit(":", 1)[0] + ":0")
    if version is not None:
        client.create_registered_model("listed")
        client.create_model_version("listed", source=str(tmp_path), run_id=run_id, tags={"run_key": key, **version})
    shown = describe_run(client, client.get_run(run_id))
    assert (shown["state"], shown["epochs"], shown["resumable"]) == listed, shown


def test_a_run_killed_in_register_model_waits_for_registration_and_its_resume_finishes_it(tmp_path: Path) -> None:
    """Stopped as register-model starts (a SIGTERM, Ctrl-C): listed as waiting for registration, not finished. The
    resume finds the fit finished (its record in storage, the record's digest in MLflow), trains nothing and
    registers one version, applied; the run is then listed finished. A real SQLite store and registry, no Ray."""
    from prefect.exceptions import TerminationSignal

    from flows.command import describe_run
    from raytrain_driver.fit import _confirm_finished
    from raytrain_driver.fit_record import finished_fit, write_fit_record
    from raytrain_driver.preflight import resolve_code, shown_params
    from raytrain_driver.register import APPLIED_TAG, register
    from raytrain_tasks.storage.locations import RUNS_DIR, locate
    from tests.helpers import (
        REGISTRY_CODE,
        a_stop_in_the_next_mlflow_query,
        fit_context,
        fit_for_registry,
        small_config,
    )

    key = "20261127-060000-eeeeee"
    config = small_config(tmp_path, train_code=REGISTRY_CODE, model_name="waiting", experiment_name="waiting", epochs=1)
    client = MlflowClient(config.mlflow_tracking_uri, registry_uri=config.mlflow_tracking_uri)
    fit = fit_for_registry(client, tmp_path, config, None, key, 0.9)  # its MLflow run FINISHED, as the fit ends it
    spec = resolve_code(config)
    for name, value in shown_params(config, spec).items():
        client.log_param(fit.mlflow_run_id, name, str(value))
    client.log_metric(fit.mlflow_run_id, "val_accuracy", 0.9, step=1)
    run_dir = locate(config.storage_path, config.storage_options).child(RUNS_DIR).child(key)
    write_fit_record(run_dir, client, fit.mlflow_run_id, fit, None)

    with a_stop_in_the_next_mlflow_query(), pytest.raises(TerminationSignal):
        register(config, None, fit)
    run = client.get_run(fit.mlflow_run_id)
    assert run.info.status == "KILLED"
    shown = describe_run(client, run)
    assert (shown["state"], shown["epochs"], shown["resumable"]) == ("waiting for registration", "1/1", "yes")

    # What `resume` does with it: distributed-fit finds the finished fit and trains nothing, then register-model.
    finished = finished_fit(run_dir, client, fit.mlflow_experiment_id, key)
    assert finished == fit
    resumed = _confirm_finished(fit_context(config, key, spec=spec, client=client), fit.mlflow_experiment_id, finished)
    ref = register(config, None, resumed)
    assert (ref.version, ref.decision, ref.aliases) == ("1", "promote", ("champion",)), ref
    assert client.get_model_version("waiting", "1").tags[APPLIED_TAG] == "true"
    shown = describe_run(client, client.get_run(fit.mlflow_run_id))
    assert (shown["state"], shown["epochs"], shown["resumable"]) == ("finished", "1/1", "-")
