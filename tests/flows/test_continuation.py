"""Continuing a crashed flow run: what the continuation takes from the chain of runs, and where it stops.

Flow runs are created in the test Prefect API with the states and tags the deployment's runs leave behind; the
end-to-end kill and continuation against `prefect server` and a process worker is in test_prefect_server.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect import flow, tags
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.states import Completed, Crashed, Failed, Running

from flows import continuation
from flows.continuation import (
    HEARTBEAT_SECONDS,
    HEARTBEAT_TAG,
    SILENCE_ENV,
    SILENCE_SECONDS,
    ZOMBIE_AUTOMATION,
    continuation_of,
    ensure_zombie_automation,
    prepare_recovery,
)
from raytrain_tasks.errors import ContinuationError
from tests.helpers import small_config

pytestmark = pytest.mark.usefixtures("prefect_api")

KEY = "20261123-110000-abcdef"


@flow(name="training-pipeline-stand-in")
def stand_in() -> None:
    """Only its flow record is used: the runs below are created with their final states."""


def _run(parameters: dict[str, Any], tags: list[str], state: Any = None) -> str:
    with get_client(sync_client=True) as client:
        created = client.create_flow_run(stand_in, parameters=parameters, tags=tags, state=state or Crashed())
    return f"prefect.flow-run.{created.id}"  # as the trigger passes it: the Crashed event's resource id


def test_a_crash_is_continued_with_the_first_runs_settings_and_its_run_key(tmp_path: Path) -> None:
    config = small_config(tmp_path, epochs=7, max_crash_resumes=2)
    crashed = _run(config.model_dump(mode="json"), ["training", f"run-key:{KEY}"])
    continuation = continuation_of(crashed)
    assert (continuation.run_key, continuation.crashes) == (KEY, 1)
    assert continuation.config.resume == KEY and continuation.config.epochs == 7

    # The continuation crashes too: its own settings are the deployment's, the chain's first run decides.
    again = _run({"epochs": 3, "continue_flow_run": crashed}, [f"run-key:{KEY}"])
    continuation = continuation_of(again)
    assert (continuation.run_key, continuation.crashes, continuation.config.epochs) == (KEY, 2, 7)


def test_a_crash_loop_stops_at_max_crash_resumes_and_says_how_to_go_on(tmp_path: Path) -> None:
    config = small_config(tmp_path, max_crash_resumes=1)
    crashed = _run(config.model_dump(mode="json"), [f"run-key:{KEY}"])
    assert continuation_of(crashed).crashes == 1
    again = _run({"continue_flow_run": crashed}, [f"run-key:{KEY}"])
    with pytest.raises(ContinuationError, match=rf"crashed 2 times .*max_crash_resumes=1.*resume={KEY}"):
        continuation_of(again)

    off = small_config(tmp_path, max_crash_resumes=0)
    with pytest.raises(ContinuationError, match="max_crash_resumes=0"):
        continuation_of(_run(off.model_dump(mode="json"), [f"run-key:{KEY}"]))


def test_only_a_crashed_run_is_continued(tmp_path: Path) -> None:
    config = small_config(tmp_path).model_dump(mode="json")
    finished = _run(config, [f"run-key:{KEY}"], state=Completed())
    with pytest.raises(ContinuationError, match="is Completed, not Crashed"):
        continuation_of(finished)
    with pytest.raises(ContinuationError, match="not a flow run id"):
        continuation_of("prefect.flow-run.not-a-uuid")


def test_a_run_that_crashed_before_it_had_a_run_key_starts_afresh(tmp_path: Path) -> None:
    config = small_config(tmp_path).model_dump(mode="json")
    continuation = continuation_of(_run(config, ["training"]))
    assert continuation.run_key is None and continuation.config.resume == ""


def _watches() -> list[Any]:
    with get_client(sync_client=True) as client:
        return list(client.read_automations_by_name(ZOMBIE_AUTOMATION))


def test_the_zombie_watch_exists_once_however_many_runs_ensure_it() -> None:
    errors: list[BaseException] = []

    def ensure() -> None:
        try:
            ensure_zombie_automation("training-pipeline")
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=ensure) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors  # two processes deleting the same duplicate is not an error
    ensure_zombie_automation("training-pipeline")
    (watch,) = _watches()
    trigger = watch.trigger.model_dump(mode="json")
    assert trigger["posture"] == "Proactive" and trigger["within"] == SILENCE_SECONDS
    assert {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{HEARTBEAT_TAG}"} in trigger[
        "match_related"
    ]
    assert watch.actions[0].model_dump()["state"] == StateType.CRASHED


def test_the_watch_window_is_a_setting_of_at_least_two_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """PREFECT_RAYTRAIN_ZOMBIE_SILENCE_SECONDS changes the server's watch where runs (or serve) start; a window
    under two heartbeats is refused naming the setting, and nothing is changed."""
    monkeypatch.setenv(SILENCE_ENV, "60")
    ensure_zombie_automation("training-pipeline")
    (watch,) = _watches()
    assert watch.trigger.model_dump(mode="json")["within"] == 60 and "60 s" in watch.actions[0].message
    for bad in ("45", "two minutes"):
        monkeypatch.setenv(SILENCE_ENV, bad)
        with pytest.raises(ContinuationError, match=f"{SILENCE_ENV}=.*at least 60"):
            ensure_zombie_automation("training-pipeline")
    assert _watches()[0].trigger.model_dump(mode="json")["within"] == 60
    monkeypatch.delenv(SILENCE_ENV)
    ensure_zombie_automation("training-pipeline")  # back to the default: the watch follows
    (watch,) = _watches()
    assert watch.trigger.model_dump(mode="json")["within"] == SILENCE_SECONDS


@flow(name="zombie-check")
def lost_run() -> None:
    """Only its flow record is used: a run of it is created Running, and then nothing of it beats any more."""


@pytest.mark.chaos  # a real window: about 35 s of waiting on the server's watch
def test_a_run_lost_just_after_the_watch_window_changed_is_still_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Changing the watch's window (a run or `serve` started with another PREFECT_RAYTRAIN_ZOMBIE_SILENCE_SECONDS)
    must not forget the runs it already watches: a run whose last heartbeat came before the change (its machine
    lost moments later, so no other beat follows) is still set Crashed. Windows of seconds here, through the
    watch's own window function (the setting's floor is 60 s, Prefect's 10 s); the server's triggers service
    does the rest."""
    monkeypatch.setattr(continuation, "silence_seconds", lambda: 14)
    ensure_zombie_automation("zombie-check")
    with get_client(sync_client=True) as client:
        lost = client.create_flow_run(lost_run, tags=[HEARTBEAT_TAG], state=Running())
    continuation._heartbeat_now(lost, "zombie-check", [HEARTBEAT_TAG])  # its last beat
    time.sleep(3)  # the server takes it under the watch as it is (so the change below must not forget it)
    monkeypatch.setattr(continuation, "silence_seconds", lambda: 10)
    ensure_zombie_automation("zombie-check")  # the window changes; no beat of the run follows
    deadline = time.monotonic() + 45
    while (state := _state(lost.id)).type != StateType.CRASHED:
        assert time.monotonic() < deadline, f"the lost run is still {state.type.value} 45 s after the change"
        time.sleep(1)
    assert "no heartbeat for 10 s" in str(state.message)


def _state(flow_run_id: UUID) -> Any:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


@flow(name="heartbeat-check")
def starting_run() -> None:
    prepare_recovery(KEY)


def test_a_watched_run_that_beats_too_rarely_is_refused_before_it_trains() -> None:
    """Fail closed: a run under the 120 s watch that sends heartbeats every 180 s (Prefect's default) would be set
    Crashed while it trains. It fails at start naming the setting; with 30 s it starts, tagged with its run key."""
    with tags(HEARTBEAT_TAG), pytest.raises(ContinuationError, match="PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30"):
        starting_run()
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: HEARTBEAT_SECONDS}), tags(HEARTBEAT_TAG):
        state = starting_run(return_state=True)
    assert state.is_completed()
    with get_client(sync_client=True) as client:
        started = client.read_flow_run(state.state_details.flow_run_id)
    assert f"run-key:{KEY}" in started.tags


def test_a_crashed_run_from_before_settings_were_parameters_is_not_continued_with_defaults(tmp_path: Path) -> None:
    """A run created with the old single `config` parameter must not be continued as if it had set nothing."""
    config = small_config(tmp_path, epochs=7).model_dump(mode="json")
    with pytest.raises(ContinuationError, match="one `config` parameter.*nothing was trained"):
        continuation_of(_run({"config": config}, [f"run-key:{KEY}"]))


def test_a_crash_the_trigger_fired_for_twice_is_continued_by_one_run_and_the_other_ends_cancelled(
    tmp_path: Path,
) -> None:
    """Prefect's crash trigger can start two continuations of one crash (seen on `prefect server`: two runs 0.4 s
    apart for one Crashed event). The first continues it; a later one ends Cancelled at once, without training and
    without the Failed state the run lease would otherwise give it."""
    from flows.continuation import earlier_continuation
    from flows.training import training_pipeline

    crashed = _run(small_config(tmp_path).model_dump(mode="json"), [f"run-key:{KEY}"])
    first = _run({"continue_flow_run": crashed}, [], state=Running())
    second = _run({"continue_flow_run": crashed}, [], state=Running())
    first_id, second_id = (UUID(run.removeprefix("prefect.flow-run.")) for run in (first, second))
    assert earlier_continuation(crashed, first_id) is None
    assert earlier_continuation(crashed, second_id).id == first_id

    state = training_pipeline(continue_flow_run=crashed, return_state=True)
    assert state.type == StateType.CANCELLED, state
    assert str(first_id) in state.message and "without training" in state.message
    assert not (tmp_path / "storage" / "runs").exists()  # nothing trained

    # A continuation that failed leaves the crash to the next one, e.g. a person's run with the same parameter.
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(first_id, Failed(), force=True)
    assert earlier_continuation(crashed, second_id) is None
