"""Against a real `mlflow server`: the registry lock, one version per run key, a promotion gate that fails closed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from raytrain_driver.champion_history import read_history
from raytrain_driver.fit_record import FitResult
from raytrain_driver.register import APPLIED_TAG
from raytrain_driver.registry_lock import QUEUE_SUFFIX, ticket_owner
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import PromotionError
from raytrain_tasks.tracking import runs as tracking
from tests.helpers import (
    REGISTRY_CODE,
    REPO_ROOT,
    MlflowServer,
    a_stop_in_the_next_mlflow_query,
    fit_for_registry,
    free_port,
    register_for_test,
    seed_mlflow_store,
    small_config,
    start_mlflow_server,
    stop_process_group,
)

LEASE_S = 4.0


def test_a_stop_while_the_model_is_logged_ends_register_model_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """register-model logs the model inside MLflow's start_run, whose exit writes the run's end. A SIGTERM raised
    in one of log_model's queries held that query's SQLite lock while the exit wrote: it waited 20 s, then
    'database is locked' replaced the stop, and the run was not marked KILLED (test_signals, register-model)."""
    import mlflow
    import torch
    from prefect.exceptions import TerminationSignal

    from raytrain_driver.register import _log_pt2

    uri = f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}"
    client = tracking.connect(uri)
    experiment = client.create_experiment("stopped", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    log_model = mlflow.pytorch.log_model

    def stopped_in_a_query(*args: Any, **kwargs: Any) -> Any:
        with a_stop_in_the_next_mlflow_query():
            return log_model(*args, **kwargs)

    monkeypatch.setattr(mlflow.pytorch, "log_model", stopped_in_a_query)
    fit = FitResult.model_construct(mlflow_run_id=run_id)
    try:
        with tracking.using_tracking_uri(uri), pytest.raises(TerminationSignal):
            _log_pt2(fit, torch.nn.Linear(3, 2), torch.zeros(2, 3), {}, artifacts=None)
    finally:
        while mlflow.active_run() is not None:  # what a failed start_run exit left on this process's run stack
            mlflow.end_run()
    assert client.get_run(run_id).info.status == "FAILED"  # start_run's exit; register-model then marks it KILLED


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.window  # holders of seconds, and a lock that expires after them
def test_lock_serialises_pipelines_and_outlives_a_killed_holder(mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(mlflow_server)
    client.create_registered_model("locked")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}

    def contender(owner: str, hold_s: float) -> subprocess.Popen[bytes]:
        args = [mlflow_server, "locked", owner, str(hold_s), str(LEASE_S), str(tmp_path)]
        return subprocess.Popen([sys.executable, "-m", "tests.lock_contender", *args], env=env, cwd=REPO_ROOT)

    holder = contender("doomed", 600)
    deadline = time.monotonic() + 60
    while not (tmp_path / "doomed.in").exists():
        assert holder.poll() is None and time.monotonic() < deadline, "the first contender never took the lock"
        time.sleep(0.2)
    waiters = [contender(f"run-{i}", 0.5) for i in range(3)]
    deadline = time.monotonic() + 60
    while len(client.search_model_versions(f"name = 'locked{QUEUE_SUFFIX}'")) < 4:  # the holder's and 3 waiters'
        assert time.monotonic() < deadline, "the waiters never took their tickets"
        time.sleep(0.2)
    os.kill(holder.pid, signal.SIGKILL)
    killed_at = time.time()
    holder.wait()
    for waiter in waiters:
        assert waiter.wait(timeout=120) == 0  # nobody fails because of the dead holder
    spans = sorted(
        (float((tmp_path / f"run-{i}.in").read_text()), float((tmp_path / f"run-{i}.out").read_text()))
        for i in range(3)
    )
    assert spans[0][0] > killed_at  # nobody entered while the holder lived
    # Taken over once its lease ran out (the waiters' 120 s above fail a lock that never is): the seconds are a
    # figure, not an assertion (a loaded machine stretches them).
    taken_over = spans[0][0] - killed_at
    print(f"\nthe dead holder's lock was taken over {taken_over:.1f} s after the kill ({LEASE_S:g} s lease)")
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))  # one at a time
    tags = client.get_registered_model("locked").tags
    assert tags["counter"] == "3"  # each decision saw the one before it: no lost update
    assert sorted(tags[f"seen.run-{i}"] for i in range(3)) == ["0", "1", "2"]
    assert client.search_model_versions(f"name = 'locked{QUEUE_SUFFIX}'") == []  # every ticket released


@pytest.mark.parametrize(
    ("owner", "said"),
    [
        ("20261201-000009-aaaaaa", "20261201-000009-aaaaaa on vm"),  # a run key: the host is added
        ("rollback by ana@vm, to version 1", "rollback by ana@vm, to version 1"),  # named already: not twice
        ("rollback by flow run x on vm, to version 1", "rollback by flow run x on vm, to version 1"),
        ("rollback by ana@vm2, to version 1", "rollback by ana@vm2, to version 1 on vm"),  # another host
        ("rollback by ana@vm.lan", "rollback by ana@vm.lan on vm"),
    ],
)
def test_a_tickets_owner_names_its_host_once(owner: str, said: str) -> None:
    assert ticket_owner(owner, "vm") == said


# --- register-model, fed a fit as distributed-fit leaves it ---------------------------------------------------


@pytest.fixture(scope="module")
def registry(
    mlflow_server: MlflowServer, tmp_path_factory: pytest.TempPathFactory, prefect_api: None
) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("registry")
    # The registry's decisions on fits of a user's code (tests/registry_code.py; fit_for_registry makes them).
    config = small_config(
        workdir,
        train_code=REGISTRY_CODE,
        mlflow_tracking_uri=str(mlflow_server),
        model_name="gate",
        experiment_name="gate",
    )
    client = MlflowClient(mlflow_server)
    # Here, not by whichever test fits first: each test stands alone (pytest-xdist may run them in two processes).
    tracking.ensure_experiment(client, config.experiment_name, config.mlflow_tracking_uri, config.storage_path)
    return {"config": config, "workdir": workdir, "dataset": None, "client": client}


def _versions(client: MlflowClient, name: str) -> list[str]:
    return sorted(str(v.version) for v in client.search_model_versions(f"name = '{name}'"))


def _champion(client: MlflowClient, name: str) -> str | None:
    version = client.get_registered_model(name).aliases.get("champion")
    return None if version is None else str(version)


def _with_champion(registry: dict[str, Any], name: str, run_key: str) -> tuple[TrainingConfig, str]:
    """The registry's config under its own model name, whose first version (val_accuracy 0.5) is its champion:
    each test that needs a champion makes its own, so it passes alone, in any order or process."""
    config = registry["config"].model_copy(update={"model_name": name})
    fit = fit_for_registry(registry["client"], registry["workdir"], config, registry["dataset"], run_key, 0.5)
    first = register_for_test(config, registry["dataset"], fit)
    assert first.aliases == ("champion",), first
    return config, first.version


def test_one_version_per_run_key_however_often_register_runs(registry: dict[str, Any]) -> None:
    config, dataset, client = registry["config"], registry["dataset"], registry["client"]
    fit = fit_for_registry(client, registry["workdir"], config, dataset, "20261123-010000-aaaaaa", 0.5)
    ref = register_for_test(config, dataset, fit)
    assert ref.aliases == ("champion",) and ref.decision == "promote"
    again = register_for_test(config, dataset, fit)  # a Prefect retry, or a resume of the finished run
    assert (again.version, again.decision, again.aliases) == (ref.version, "promote", ("champion",))
    # A newcomer's resume of a finished run printed the old decision as if it were made now.
    assert ref.reason == "no champion yet"
    assert again.reason == "no champion yet; decided earlier, when this run registered the version"
    assert _versions(client, "gate") == [ref.version]
    # The promotion is in the model's champion history once, though register-model ran twice.
    (move,) = read_history(client, "gate")[0].moves
    assert (move.version, move.previous, move.run_key, move.reason) == (ref.version, None, fit.run_key, ref.reason)
    logged = client.search_logged_models(experiment_ids=[fit.mlflow_experiment_id])
    assert [m.source_run_id for m in logged].count(fit.mlflow_run_id) == 1  # the model was logged once


def test_a_champion_that_cannot_be_scored_keeps_its_alias_and_fails_the_task(
    registry: dict[str, Any], mlflow_server: MlflowServer
) -> None:
    dataset, client = registry["dataset"], registry["client"]
    config, champion = _with_champion(registry, "unscorable", "20261123-011000-abcabc")
    # The champion's model files become unreadable (deleted from the artifact store behind MLflow's back).
    source = client.get_model_version("unscorable", champion).source
    model_id = source.rsplit("/", 1)[-1]
    (model_dir,) = list(mlflow_server.artifacts.rglob(model_id))
    aside = model_dir.with_name(model_id + ".aside")
    model_dir.rename(aside)
    try:
        fit = fit_for_registry(client, registry["workdir"], config, dataset, "20261123-020000-bbbbbb", 0.99)
        error = register_for_test(config, dataset, fit)
        assert isinstance(error, PromotionError) and "No alias moved" in str(error)
        assert _champion(client, "unscorable") == champion  # not replaced by a model it could not be compared with
        (candidate,) = [v for v in _versions(client, "unscorable") if v != champion]
        assert str(client.get_registered_model("unscorable").aliases["challenger"]) == candidate
        tags = client.get_model_version("unscorable", candidate).tags
        assert tags["promotion.decision"] == "undecided"
        assert f"version {champion}" in tags["promotion.reason"] and "failed" in tags["promotion.reason"]
    finally:
        aside.rename(model_dir)
    # The next attempt of the same run key redoes only the decision: same version, now promoted.
    retried = register_for_test(config, dataset, fit)
    assert retried.version == candidate and retried.decision == "promote"
    assert _champion(client, "unscorable") == candidate
    assert str(client.get_registered_model("unscorable").aliases["previous_champion"]) == champion
    assert len(_versions(client, "unscorable")) == 2


def test_a_champion_with_another_input_schema_is_kept_unless_asked(registry: dict[str, Any]) -> None:
    client, workdir = registry["client"], registry["workdir"]
    config, champion = _with_champion(registry, "schema", "20261123-021000-abcabc")
    other = config.model_copy(update={"train_config": {"features": 8}})  # another table: 8 features, not 4
    dataset = None
    fit = fit_for_registry(client, workdir, other, dataset, "20261123-030000-cccccc", 0.99)
    kept = register_for_test(other, dataset, fit)
    assert kept.decision == "keep_incomparable_champion" and kept.aliases == ("challenger",)
    assert "schema" in kept.reason and "replace_incomparable_champion" in kept.reason
    assert _champion(client, "schema") == champion

    replacing = other.model_copy(update={"replace_incomparable_champion": True})
    fit = fit_for_registry(client, workdir, replacing, dataset, "20261123-040000-dddddd", 0.2)
    replaced = register_for_test(replacing, dataset, fit)
    assert replaced.decision == "replace_incomparable_champion" and _champion(client, "schema") == replaced.version


def test_a_champion_stored_as_a_pickle_is_never_loaded(registry: dict[str, Any], tmp_path: Path) -> None:
    """A champion in MLflow's pickle format (registered by hand, or by another tool) would run code when scored.
    It is not loaded: it keeps its alias as incomparable, with the reason, and the code in it never runs."""
    import mlflow
    import torch

    from raytrain_driver.preflight import resolve_code
    from raytrain_driver.register_steps import user_schema, version_tags

    config, client, workdir = registry["config"], registry["client"], registry["workdir"]
    marker = tmp_path / "pwned"

    class Trap(torch.nn.Module):
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    pickled = config.model_copy(update={"model_name": "pickled"})
    dataset = registry["dataset"]
    mlflow.set_tracking_uri(config.mlflow_tracking_uri)
    with mlflow.start_run(experiment_id=client.get_experiment_by_name(config.experiment_name).experiment_id):
        info = mlflow.pytorch.log_model(Trap(), name="model", serialization_format="pickle", pip_requirements=[])
    spec = resolve_code(pickled)
    tags = version_tags(pickled, spec, 0.5, user_schema(pickled, spec, None))  # as this code's own champion says
    version = mlflow.register_model(info.model_uri, "pickled", tags=tags).version
    client.set_registered_model_alias("pickled", "champion", str(version))
    assert not marker.exists()

    fit = fit_for_registry(client, workdir, pickled, dataset, "20261123-050000-eeeeee", 0.99)
    kept = register_for_test(pickled, dataset, fit)
    assert kept.decision == "keep_incomparable_champion" and "pickled torch model" in kept.reason, kept
    assert _champion(client, "pickled") == str(version)
    assert not marker.exists()


def test_the_run_page_says_no_alias_moved_when_the_decision_failed(registry: dict[str, Any]) -> None:
    """What the flow publishes when register-model fails: the failure, that no alias moved, and no secret."""
    from prefect import flow, get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.runtime import flow_run

    from flows.training import PipelineResult
    from tasks.run_page import publish_run_summary

    config, client, dataset = registry["config"], registry["client"], registry["dataset"]
    fit = fit_for_registry(client, registry["workdir"], config, dataset, "20261123-060000-ffffff", 0.7)
    result = PipelineResult(run_key=fit.run_key, config=config, dataset=dataset, fit=fit, model=None)
    error = PromotionError("cannot read gate@champion: http://admin:pw-on-page-1@127.0.0.1:1/api failed")

    @flow(name="run-page-only")
    def publish() -> str:
        publish_run_summary(result, registry_error=f"{type(error).__name__}: {error}")
        return str(flow_run.get_id())

    flow_run_id = publish()
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    (page,) = [artifact for artifact in artifacts if artifact.key == "training-summary"]
    assert all("pw-on-page-1" not in str(artifact.data) for artifact in artifacts)
    assert "register-model failed, no alias moved" in page.data and "PromotionError" in page.data
    assert "pw-on-page-1" not in page.data and "admin:***@" in page.data


def test_two_pipelines_registering_at_once_decide_one_after_the_other(registry: dict[str, Any]) -> None:
    """Two register-model tasks of two runs, started together on one model: each registers its own version, and
    the second decides against the champion the first left (no lost update: never both against "none")."""
    config = registry["config"].model_copy(update={"model_name": "duo"})
    dataset, client, workdir = registry["dataset"], registry["client"], registry["workdir"]
    fits = [
        fit_for_registry(client, workdir, config, dataset, key, score)
        for key, score in (("20261123-070000-aaaaaa", 0.6), ("20261123-080000-bbbbbb", 0.9))
    ]
    results: dict[str, Any] = {}
    barrier = threading.Barrier(2)

    def register(fit: FitResult) -> None:
        barrier.wait()
        results[fit.run_key] = register_for_test(config, dataset, fit)

    threads = [threading.Thread(target=register, args=(fit,)) for fit in fits]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refs = [results[fit.run_key] for fit in fits]
    assert not any(isinstance(ref, BaseException) for ref in refs), refs
    assert sorted(ref.version for ref in refs) == _versions(client, "duo")  # one version each, nothing more
    (first,) = [ref for ref in refs if ref.champion_version is None]  # exactly one decided with no champion
    (second,) = [ref for ref in refs if ref is not first]
    assert second.champion_version == first.version  # the other saw the first's decision
    tags = client.get_model_version("duo", second.version).tags
    assert tags["promotion.champion_version"] == first.version and tags[APPLIED_TAG] == "true"
    expected = second.version if second.decision == "promote" else first.version
    assert _champion(client, "duo") == expected
    assert client.search_model_versions(f"name = 'duo{QUEUE_SUFFIX}'") == []  # both tickets released


def _taken_over_while_looking_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder freezes longer than the lease while it looks up its version: another waiter deletes its ticket."""
    import raytrain_driver.register as register

    looked_up = register._version_of_run

    def frozen_then_taken_over(client: MlflowClient, name: str, run_key: str) -> str | None:
        for ticket in client.search_model_versions(f"name = '{name}{QUEUE_SUFFIX}'"):
            client.delete_model_version(ticket.name, ticket.version)  # what a waiter does to a stale ticket
        return looked_up(client, name, run_key)

    monkeypatch.setattr(register, "_version_of_run", frozen_then_taken_over)


def test_a_holder_whose_lock_was_taken_over_registers_nothing(
    registry: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder frozen for longer than the lease (a stopped VM) is taken over: another waiter deletes its ticket
    while it is looking up its version. It must not register a version it no longer holds the lock for."""

    config = registry["config"].model_copy(update={"model_name": "takeover"})
    dataset, client, workdir = registry["dataset"], registry["client"], registry["workdir"]
    _taken_over_while_looking_up(monkeypatch)
    error = register_for_test(
        config, dataset, fit_for_registry(client, workdir, config, dataset, "20261123-083000-cccccc", 0.7)
    )
    assert isinstance(error, Exception) and "lost the promotion lock" in str(error), error
    assert _versions(client, "takeover") == []  # nothing registered under a lock that was not held


def test_a_holder_whose_lock_was_taken_over_does_not_finish_an_interrupted_promotion(
    registry: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed between moving `champion` and marking its decision applied is finished by its next attempt
    (previous_champion set): that repair moves an alias, so it too needs the lock to still be held."""

    config = registry["config"].model_copy(update={"model_name": "repair"})
    dataset, client, workdir = registry["dataset"], registry["client"], registry["workdir"]
    first = register_for_test(
        config, dataset, fit_for_registry(client, workdir, config, dataset, "20261123-084000-aaaaaa", 0.5)
    )
    fit = fit_for_registry(client, workdir, config, dataset, "20261123-085000-bbbbbb", 0.9)
    second = register_for_test(config, dataset, fit)
    assert (first.decision, second.decision, _champion(client, "repair")) == ("promote", "promote", second.version)
    # As a kill right after `champion` moved leaves it: neither previous_champion nor the applied mark.
    client.delete_registered_model_alias("repair", "previous_champion")
    client.delete_model_version_tag("repair", second.version, APPLIED_TAG)

    _taken_over_while_looking_up(monkeypatch)
    error = register_for_test(config, dataset, fit)
    assert isinstance(error, Exception) and "lost the promotion lock" in str(error), error
    assert "previous_champion" not in client.get_registered_model("repair").aliases  # nothing moved
    assert APPLIED_TAG not in client.get_model_version("repair", second.version).tags


def test_a_champion_moved_while_the_holder_assessed_it_is_not_overwritten(
    registry: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder frozen past its lease while it assesses the champion is overtaken by a pipeline
    that moves `champion`; woken, it must not move `champion` over that one on a decision made against the old."""
    import raytrain_driver.register as register

    config, first = _with_champion(registry, "overtaken", "20261206-090000-aaaaaa")
    dataset, client, workdir = registry["dataset"], registry["client"], registry["workdir"]
    other = register_for_test(
        config.model_copy(update={"promote": False}),
        dataset,
        fit_for_registry(client, workdir, config, dataset, "20261206-090100-bbbbbb", 0.6),
    )
    assessed = register._current_champion

    def overtaken_while_assessing(*args: Any) -> Any:
        found = assessed(*args)
        client.set_registered_model_alias("overtaken", "champion", other.version)  # the other pipeline's move
        return found

    monkeypatch.setattr(register, "_current_champion", overtaken_while_assessing)
    fit = fit_for_registry(client, workdir, config, dataset, "20261206-090200-cccccc", 0.9)
    error = register_for_test(config, dataset, fit)
    assert isinstance(error, Exception) and f"champion is version {other.version} now, not {first}" in str(error)
    assert _champion(client, "overtaken") == other.version  # not overwritten
    monkeypatch.setattr(register, "_current_champion", assessed)
    retried = register_for_test(config, dataset, fit)  # decides again, against the champion it finds
    assert (retried.decision, _champion(client, "overtaken")) == ("promote", retried.version), retried
    assert client.get_registered_model("overtaken").aliases["previous_champion"] == other.version


@pytest.mark.slow
@pytest.mark.chaos
def test_a_registry_outage_in_the_middle_of_the_decision_moves_nothing_and_a_retry_decides(
    tmp_path_factory: pytest.TempPathFactory, prefect_api: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mlflow server` stops after the candidate's version is registered and before the champion is read: the
    task fails (no alias moves, the version is not marked decided); with the server back, the next attempt of
    the same run key decides on that same version."""
    import raytrain_driver.register as register
    import raytrain_driver.registry_lock as registry_lock

    # A short lock lease, so the retry waits seconds, not a minute, for the failed attempt's ticket to go stale.
    monkeypatch.setattr(registry_lock, "LEASE_S", 5.0)
    root = tmp_path_factory.mktemp("outage")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(root, port)
    try:
        workdir = root / "work"
        config = small_config(
            workdir, train_code=REGISTRY_CODE, mlflow_tracking_uri=url, model_name="outage", experiment_name="outage"
        )  # fits of a user's code (fit_for_registry), as above
        dataset = None
        client = MlflowClient(url)
        champion = register_for_test(
            config, dataset, fit_for_registry(client, workdir, config, dataset, "20261123-090000-aaaaaa", 0.5)
        )
        assert champion.decision == "promote"

        assess = register.assess_user_champion
        stopped = []

        def outage(*args: Any, **kwargs: Any) -> Any:
            stop_process_group(server)  # the registry goes away in the middle of the decision
            stopped.append(True)
            return assess(*args, **kwargs)

        monkeypatch.setattr(register, "assess_user_champion", outage)
        fit = fit_for_registry(client, workdir, config, dataset, "20261123-100000-bbbbbb", 0.99)
        error = register_for_test(config, dataset, fit)
        assert stopped and isinstance(error, Exception), error  # the task ended Failed
        assert "outage version 2" in str(error), error

        server = start_mlflow_server(root, port)
        monkeypatch.setattr(register, "assess_user_champion", assess)
        assert _champion(client, "outage") == champion.version  # nothing moved
        assert _versions(client, "outage") == [champion.version, "2"]
        assert APPLIED_TAG not in client.get_model_version("outage", "2").tags
        assert "challenger" not in client.get_registered_model("outage").aliases

        retried = register_for_test(config, dataset, fit)  # waits out the failed attempt's lock ticket, then decides
        assert (retried.version, retried.decision, retried.champion_version) == ("2", "promote", champion.version)
        assert _champion(client, "outage") == "2"
        assert str(client.get_registered_model("outage").aliases["previous_champion"]) == champion.version
        assert _versions(client, "outage") == [champion.version, "2"]
    finally:
        stop_process_group(server)
