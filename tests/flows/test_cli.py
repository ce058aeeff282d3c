"""The seeds' quick start, run as a user would: `python -m flows.training ...` in a fresh directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.helpers import REPO_ROOT, joins_this_ray, seed_mlflow_store


def _cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    # Nested and missing, as `make run` sets it (.pipeline/prefect): the CLI must create it.
    env["PREFECT_HOME"] = str(tmp_path / ".pipeline" / "prefect")
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def _run_cli(
    tmp_path: Path, *args: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``env``: added to the command's environment (e.g. the session's Ray and Prefect API, to skip their starts)."""
    return subprocess.run(
        [sys.executable, "-m", "flows.training", *args],
        cwd=tmp_path,
        env={**_cli_env(tmp_path), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_cli_runs_the_pipeline_on_embedded_defaults(tmp_path: Path) -> None:
    proc = _run_cli(tmp_path, "--num-workers", "2", "--epochs", "2", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "training pipeline finished" in proc.stdout
    summary = proc.stdout[proc.stdout.index("training pipeline finished") :]
    assert "-> champion" in summary and "val_accuracy=" in summary
    state = tmp_path / ".pipeline"
    assert (state / "mlflow.db").is_file()
    runs = list((state / "storage" / "runs").iterdir())
    assert len(runs) == 1 and sorted(p.name for p in runs[0].glob("epoch-*")) == ["epoch-0001", "epoch-0002"]
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    version = client.get_model_version_by_alias("digits-classifier", "champion")
    assert version.tags["run_key"] == runs[0].name
    assert runs[0].name in summary

    # A quiet console: the pipeline's progress and summary, not what each library says about itself.
    console = proc.stdout + proc.stderr
    assert "epoch 1/2 committed" in console and "epoch 2/2 committed" in console
    assert "digits-classifier version 1 (test_accuracy" in console  # the registry decision, said once
    for noise in NOISE:
        assert noise not in console, noise
    # What --verbose shows (the Ray processes' own output too): test_security's credentials test, whose first run
    # is verbose, so that no password hides in that output either.


# What a default run printed before the console was quieted, none of it for the user to act on.
NOISE = (
    "(KeepResumedController pid=",  # Ray Train's controller (raytrain_driver.retention): its worker-group lines
    "(RayTrainWorker pid=",  # each worker's output, its epoch lines repeating the driver's
    "Token authentication is enabled",
    "Creating initial MLflow database tables",
    "can be interpreted in multiple ways",  # MLflow's UserWarning about the dataset source
    "Starting temporary server",
    "Successfully registered model",  # MLflow's fluent register_model printing for itself
    "Created version",
)


def test_cli_rejects_bad_flags_before_doing_anything(tmp_path: Path) -> None:
    proc = _run_cli(tmp_path, "--num-workers", "0", timeout=120)
    assert proc.returncode == 2 and "num_workers (--num-workers)" in proc.stderr
    # The table classifier's own setting, through the CLI's shorthand: its settings class names it.
    proc = _run_cli(tmp_path, "--dataset", "imagenet", timeout=120)
    assert proc.returncode == 2 and "train_config.dataset: Value error, unknown dataset 'imagenet'" in proc.stderr
    assert not (tmp_path / ".pipeline" / "storage").exists() and not (tmp_path / ".pipeline" / "mlflow.db").exists()


def test_train_code_that_cannot_run_is_named_before_prefect_or_ray_start(tmp_path: Path) -> None:
    """A misspelled attribute, code that cannot register as asked, or a train_config its code does not take, fails
    the command before the temporary Prefect API or Ray starts (no Prefect database, no Ray session, nothing in
    storage), naming train_code."""
    (tmp_path / "my_code.py").write_text(
        "import torch\n"
        "from raytrain_tasks.api import Metric, TrainFunc\n"
        "training = TrainFunc(lambda config: None, metric=Metric('val_loss', higher_is_better=False))\n"
    )
    misspelled = _run_cli(tmp_path, "--train-code", "my_code:trainin", timeout=120)
    assert misspelled.returncode == 2, misspelled.stderr[-3000:]
    assert "has no attribute 'trainin'" in misspelled.stderr and "did you mean 'training'" in misspelled.stderr
    unregistrable = _run_cli(tmp_path, "--train-code", "my_code:training", timeout=120)
    assert unregistrable.returncode == 2, unregistrable.stderr[-3000:]
    assert "no load_model/input_example" in unregistrable.stderr and "--no-register" in unregistrable.stderr
    # A setting the code does not declare (here a typo of the image example's `channels`) would train silently on
    # the default: refused, naming it.
    typo = _run_cli(
        tmp_path, "--train-code", "examples.image_classifier.train:training", "--train-config", '{"chanels": 8}',
        timeout=120,
    )  # fmt: skip
    assert typo.returncode == 2, typo.stderr[-3000:]
    assert "train_config sets 'chanels'" in typo.stderr and "did you mean 'channels'" in typo.stderr, typo.stderr
    # Checkpoints within an epoch for a train_func, whose own loop checkpoints: refused naming the flag.
    within = _run_cli(
        tmp_path, "--train-code", "examples.long_epochs.train:training", "--checkpoint-every-minutes", "1",
        timeout=120,
    )  # fmt: skip
    assert within.returncode == 2, within.stderr[-3000:]
    assert within.stderr.count("checkpoint_every_minutes=1 (--checkpoint-every-minutes) applies to a TrainSpec") == 1
    assert "Traceback" not in misspelled.stderr + unregistrable.stderr + typo.stderr + within.stderr
    pipeline = tmp_path / ".pipeline"
    assert not (pipeline / "storage").exists() and not (pipeline / "mlflow.db").exists()
    assert not list((pipeline / "prefect").glob("*.db")), list((pipeline / "prefect").iterdir())


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_a_failed_run_ends_with_one_message_and_the_command_that_continues_it(tmp_path: Path) -> None:
    """A bug in the user's train_func: the console gives the error once, at its end, with the user's own frame
    and the command that continues the run; Prefect's engine frames and the error's other copies (the task's and
    the flow's failed states) stay in the run's logs."""
    (tmp_path / "buggy.py").write_text(
        "import torch\n"
        "from raytrain_tasks.api import Metric, TrainFunc\n"
        "def train_func(config):\n"
        "    return config['hidden']\n"
        "training = TrainFunc(train_func, metric=Metric('val_loss', higher_is_better=False))\n"
    )
    args = ("--train-code", "buggy:training", "--epochs", "1", "--no-register", "--num-workers", "1")
    from prefect.settings import PREFECT_API_URL

    # On the session's Ray and Prefect API: the console is the subject, not their starts.
    session = {**joins_this_ray(), "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    failed = _run_cli(tmp_path, *args, timeout=300, env=session)
    assert failed.returncode == 1, failed.stderr[-3000:]
    err = failed.stderr
    assert err.count("return config['hidden']") == 1, err  # the user's frame, once
    assert "flow_engine.py" not in err and "task_engine.py" not in err, err
    assert "Finished in state Failed" not in err and "Retries are exhausted" not in err, err
    run_key = re.search(r"run key (\d{8}-\d{6}-[0-9a-f]{6})", err)
    assert run_key is not None, err
    assert err.rstrip().endswith(f"continue it with: prefect-raytrain resume {run_key.group(1)}"), err[-600:]
    message = err[err.rindex("pipeline failed:") :]  # in the command's words, not the flow parameter's
    assert "resume=" not in message and f"`prefect-raytrain resume {run_key.group(1)}`" in message, message


def test_a_failure_says_how_to_continue_in_the_commands_words() -> None:
    """The error of a run that can be continued names `resume=<run key>` (the flow parameter, as a deployment's
    user gives it); the console says the command instead, and again on its last line. A Ray Job run is continued
    with `train ... --resume` (which re-attaches to its job); a driver that lost its lease is told of no command."""
    from flows.cli import _in_cli_words
    from raytrain_tasks.config import TrainingConfig

    key = "20261205-084600-c0ffee"
    error = f"epoch 2 failed 3 times; fix the cause, then continue the run with `resume={key}` (from its last one)"
    said = _in_cli_words(error, TrainingConfig())
    assert f"continue the run with `prefect-raytrain resume {key}` (from" in said and "resume=" not in said, said
    assert said.endswith(f"\n\ncontinue it with: prefect-raytrain resume {key}"), said
    job = _in_cli_words(error, TrainingConfig(launch_mode="ray_job", ray_address="10.0.0.5:6379"))
    assert job.endswith(f"continue it with: prefect-raytrain train <the same flags> --resume {key}"), job
    assert _in_cli_words(f"a flag: --resume={key}", TrainingConfig()) == f"a flag: --resume={key}"
    lost = _in_cli_words(f"the run belongs to its holder now (or to `resume={key}`)", TrainingConfig(), False)
    assert lost == f"the run belongs to its holder now (or to `prefect-raytrain resume {key}`)", lost


def test_the_help_shows_every_default() -> None:
    """`--help` shows each setting's default (a newcomer looked up the learning rate in docs/configuration.md)."""
    from flows.cli import build_parser
    from raytrain_tasks.config import TrainingConfig

    text = " ".join(build_parser().format_help().split())
    for name, field in TrainingConfig.model_fields.items():
        default = field.get_default(call_default_factory=True)
        if default in (None, "", [], {}):
            continue
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        assert f"(default: {shown})" in text, (name, shown)
    assert "--learning-rate LEARNING_RATE Adam step size. (default: 0.003)" in text


STOP_IN_A_FINALIZER = """
import os, signal, time
import flows.cli as cli
from flows.stop_signals import send_again_a_stop_that_a_finalizer_swallowed

class Transport:  # as asyncio's transports: an object whose __del__ runs when the main thread drops it
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the finalizer
        time.sleep(0.2)

signal.signal(signal.SIGTERM, cli._stop)  # raises TerminationSignal, as Prefect's handler does
send_again_a_stop_that_a_finalizer_swallowed()
try:
    Transport()
    time.sleep(10)
    print("went on as if no signal had come")
except BaseException as exc:
    print("stopped by", type(exc).__name__)
"""


def test_a_stop_signal_that_lands_in_a_finalizer_still_stops_the_command() -> None:
    """Seen in CI: a SIGTERM whose handler ran inside an asyncio transport's ``__del__`` raised TerminationSignal
    there, Python dropped it ("Exception ignored in"), and the run went on until the stop deadline exited it with
    its MLflow run left RUNNING. The CLI (and the flow, for a cancelled served run) sends such a stop again, outside
    the finalizer."""
    finished = subprocess.run(
        [sys.executable, "-c", STOP_IN_A_FINALIZER], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert finished.stdout.strip() == "stopped by TerminationSignal", finished.stdout + finished.stderr


STOP_IN_ANOTHER_THREAD = """
import threading, time
from flows.stop_signals import send_again_a_stop_that_a_finalizer_swallowed

class Dropped:  # a KeyboardInterrupt a finalizer drops in a thread that is not the main one: no signal came
    def __del__(self):
        raise KeyboardInterrupt

send_again_a_stop_that_a_finalizer_swallowed()
thread = threading.Thread(target=Dropped)
thread.start()
thread.join()
try:
    time.sleep(1)
    print("went on")
except BaseException as exc:
    print("stopped by", type(exc).__name__)
"""


def test_a_stop_dropped_in_another_thread_is_not_sent_to_the_process() -> None:
    """Signal handlers run in the main thread only: an interrupt some library's finalizer drops in another thread
    is not a signal the process received, and must not stop it."""
    finished = subprocess.run(
        [sys.executable, "-c", STOP_IN_ANOTHER_THREAD], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert finished.stdout.strip() == "went on", finished.stdout + finished.stderr


def _running_run(db: Path, run_key: str, driver: str) -> tuple[MlflowClient, str]:
    from raytrain_tasks.tracking.run_owner import DRIVER_TAG
    from raytrain_tasks.tracking.runs import RUN_KEY_TAG

    client = MlflowClient(f"sqlite:///{seed_mlflow_store(db)}")
    experiment_id = client.create_experiment("stopped")
    run = client.create_run(experiment_id, tags={RUN_KEY_TAG: run_key, DRIVER_TAG: driver})
    return client, run.info.run_id


def test_at_the_stop_deadline_the_run_this_command_drives_is_marked_killed(tmp_path: Path) -> None:
    """Seen in CI: a SIGTERM between the fit and register-model overran the 10 s deadline and the command exited
    with its MLflow run left RUNNING. The deadline now marks it KILLED, saying how to continue it."""
    from flows.stop_signals import mark_run_killed
    from raytrain_tasks.config import TrainingConfig
    from raytrain_tasks.tracking.run_owner import KILLED_TAG, this_driver

    client, run_id = _running_run(tmp_path / "mlflow.db", "20261206-085859-7fbfbe", this_driver())
    config = TrainingConfig(
        resume="20261206-085859-7fbfbe",
        experiment_name="stopped",
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    mark_run_killed(config, "SIGTERM", 10.0)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert "stopped by SIGTERM" in run.data.tags[KILLED_TAG]
    assert "resume=20261206-085859-7fbfbe" in run.data.tags[KILLED_TAG]


def test_the_stop_deadline_leaves_a_run_another_process_drives(tmp_path: Path) -> None:
    """A Ray Job's driver, or a resume elsewhere, still trains the run: it is theirs to end."""
    from flows.stop_signals import mark_run_killed
    from raytrain_tasks.config import TrainingConfig

    client, run_id = _running_run(tmp_path / "mlflow.db", "20261206-085859-7fbfbe", "elsewhere@abc:123:456")
    config = TrainingConfig(
        resume="20261206-085859-7fbfbe",
        experiment_name="stopped",
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    mark_run_killed(config, "SIGTERM", 10.0)
    assert client.get_run(run_id).info.status == "RUNNING"


def test_the_stop_deadline_exits_even_when_mlflow_cannot_take_the_mark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The broad except in mark_run_killed: a store that cannot be read (SQLAlchemy's DatabaseError, not an
    MlflowException) is reported, and the exit goes on."""
    from flows.stop_signals import mark_run_killed
    from raytrain_tasks.config import TrainingConfig

    (tmp_path / "not-a-database").write_text("not an SQLite file, whatever its name says")
    config = TrainingConfig(
        resume="20261206-085859-7fbfbe",
        experiment_name="stopped",
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'not-a-database'}",
    )
    mark_run_killed(config, "SIGTERM", 10.0)
    assert "could not mark MLflow run of 20261206-085859-7fbfbe KILLED" in capsys.readouterr().err
