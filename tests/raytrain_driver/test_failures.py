"""Bad input fails before any worker starts, names the setting to change, and leaves nothing behind."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from flows.training import training_pipeline
from raytrain_tasks.config import parameters_of
from raytrain_tasks.errors import CheckpointError, ClusterError, DatasetError, TrackingError
from tests.helpers import small_config, this_ray_address

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster", "prefect_api")]


def _train_actors() -> set[str]:
    """Every Ray Train controller and worker actor this cluster has had, dead ones included."""
    from ray.util.state import list_actors

    return {
        actor.actor_id
        for name in ("TrainController", "RayTrainWorker")
        for actor in list_actors(address=this_ray_address(), filters=[("class_name", "=", name)], limit=10_000)
    }


def _run_failing(config: object) -> tuple[BaseException, set[str]]:
    """Run the flow, which must fail; return its error and the Ray Train actors the run started."""
    before = _train_actors()
    state = training_pipeline(**parameters_of(config), return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, BaseException)
    return error, _train_actors() - before


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _mlflow_runs(workdir: Path) -> list[object]:
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tests")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def test_gpu_requested_on_a_cluster_without_gpus(tmp_path: Path, ray_cluster: dict[str, float]) -> None:
    if ray_cluster.get("GPU"):
        pytest.skip("this cluster has GPUs; the check is for clusters without")
    error, started = _run_failing(small_config(tmp_path, use_gpu=True))
    assert isinstance(error, ClusterError)
    assert "use_gpu" in str(error) and "has 0 GPUs" in str(error)
    # Refused before Ray Train starts anything: Ray Train alone would retry the worker-group start for minutes.
    assert started == set()
    assert not (tmp_path / "storage" / "runs").exists()
    assert _mlflow_runs(tmp_path) == []


def test_more_workers_than_cpus(tmp_path: Path) -> None:
    error, started = _run_failing(small_config(tmp_path, num_workers=8))
    assert isinstance(error, ClusterError) and "num_workers" in str(error)
    assert started == set()
    assert not (tmp_path / "storage" / "runs").exists()


def test_fewer_training_rows_than_workers_is_refused_naming_the_settings(tmp_path: Path) -> None:
    """Each worker takes an equal share of the train split: with fewer rows than the most workers the run may have
    (`max_workers` 64 here, on about 28 training rows), one would get none. Refused before any worker starts,
    not retried."""
    import numpy as np
    import pandas as pd

    frame = pd.DataFrame({"a": np.arange(40.0), "b": np.arange(40.0) ** 2, "label": np.arange(40) % 2})
    frame.to_csv(tmp_path / "tiny.csv", index=False)
    tiny = {"dataset": str(tmp_path / "tiny.csv"), "label_column": "label", "num_workers": 1, "max_workers": 64}
    error, started = _run_failing(small_config(tmp_path, **tiny))
    assert isinstance(error, DatasetError), error
    assert "fewer than the 64 workers" in str(error) and "`num_workers`" in str(error) and "`max_workers`" in str(error)
    assert started == set()
    assert _mlflow_runs(tmp_path) == []


def test_unreachable_mlflow_server(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    error, started = _run_failing(small_config(tmp_path, mlflow_tracking_uri=uri))
    assert isinstance(error, TrackingError)
    assert "mlflow_tracking_uri" in str(error) and uri in str(error)
    assert started == set()  # found out before any worker starts, not by each worker in turn
    assert not (tmp_path / "storage" / "runs").exists()


def test_resume_of_an_unknown_run(tmp_path: Path) -> None:
    error, _ = _run_failing(small_config(tmp_path, resume="20200101-000000-abcdef"))
    assert isinstance(error, CheckpointError)
    assert "resume" in str(error) and "20200101-000000-abcdef" in str(error)
    assert _mlflow_runs(tmp_path) == []


def test_unwritable_storage(tmp_path: Path) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    error, _ = _run_failing(small_config(tmp_path, storage_path=str(blocker / "storage")))
    assert "storage_path" in str(error)


def test_a_failure_after_the_mlflow_run_started_marks_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only errors inside fit(): building the trainer fails here, after the MLflow run was opened."""
    from prefect import flow

    import raytrain_driver.trainer
    from raytrain_tasks.config import new_run_key
    from tasks.fit import distributed_fit
    from tests.helpers import prepared_for

    config, dataset = prepared_for(small_config(tmp_path, cpus_per_worker=0.5))

    def cannot_build(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the trainer could not be built")

    monkeypatch.setattr(raytrain_driver.trainer, "build_trainer", cannot_build)

    @flow(name="fit-only")
    def fit_only() -> BaseException | None:
        state = distributed_fit.with_options(retries=0)(config, dataset, new_run_key(), return_state=True)
        error = state.result(raise_on_failure=False)
        return error if isinstance(error, BaseException) else None

    assert fit_only() is not None
    (run,) = _mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"  # type: ignore[attr-defined]
    assert run.data.tags["prefect_raytrain.error"]  # type: ignore[attr-defined]


def test_an_exception_that_repeats_identically_stops_the_retries_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the training code (here a KeyError on the `num_epochs` of Ray's docs, raised on every attempt) was
    retried `max_failures` times by Ray Train and then `fit_retries` times by Prefect: six worker-group starts with
    these settings, and a message that the run "can continue". Now the second identical failure ends it."""
    import textwrap

    from prefect import flow

    from raytrain_tasks.config import new_run_key
    from raytrain_tasks.errors import RepeatedFailureError
    from tasks.fit import distributed_fit, is_retryable

    starts = tmp_path / "starts.txt"
    (tmp_path / "buggy_code.py").write_text(
        textwrap.dedent(
            f"""
            from raytrain_tasks.api import Metric, TrainFunc

            def train_func(config):
                with open({str(starts)!r}, "a") as out:
                    out.write("start\\n")
                return config["num_epochs"]  # ported from Ray's docs: the pipeline names it "epochs"

            training = TrainFunc(train_func, metric=Metric("val_loss", higher_is_better=False))
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config(
        tmp_path, train_code="buggy_code:training", num_workers=1, register=False, max_failures=2, fit_retries=1
    )

    @flow(name="fit-only")
    def fit_only() -> tuple[Any, bool]:
        state = distributed_fit.with_options(retries=config.fit_retries, retry_delay_seconds=0)(
            config, None, new_run_key(), return_state=True
        )
        return state.result(raise_on_failure=False), is_retryable(None, None, state)

    error, retryable = fit_only()
    assert isinstance(error, RepeatedFailureError), repr(error)
    assert not retryable
    message = str(error)
    assert "same exception on two attempts in a row" in message and "not retried" in message
    assert "KeyError: 'num_epochs'" in message and "can continue" not in message
    assert "into config as 'epochs': read that key" in message  # seen by a newcomer: it named no key before
    assert starts.read_text().count("start") == 2  # the first start and one restart: no more, no Prefect retry
    (run,) = _mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"  # type: ignore[attr-defined]
    assert "same exception" in run.data.tags["prefect_raytrain.error"]  # type: ignore[attr-defined]
