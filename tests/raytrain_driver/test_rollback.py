"""Rolling the champion back: its refusals as a table, and on a real SQLite registry the move under the model's
lock, recorded with the reason and who made it, and refusals that move nothing."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from raytrain_driver.champion_history import ROLLBACK, ChampionMove, read_history
from raytrain_driver.registry_lock import QUEUE_SUFFIX, model_lock
from raytrain_driver.rollback import Target, kept_out, refusal, roll_back, served
from raytrain_tasks.errors import RollbackError
from tests.registered_versions import registered_versions

VERSIONS = ("1", "2", "3")


@pytest.mark.parametrize(
    ("target", "champion", "reason", "refused"),
    [
        (Target("1", VERSIONS, "r1", "active"), "3", "bad model", None),
        (Target("1", VERSIONS, "r1", "active"), None, "no champion", None),  # set one, recorded as a rollback
        (Target("1", VERSIONS, "r1", "active"), "3", "  ", "needs a reason"),
        (Target("9", VERSIONS), "3", "bad model", "version 9 does not exist (its versions: 1, 2, 3)"),
        (Target("3", VERSIONS, "r3", "active"), "3", "bad model", "version 3 is the champion already"),
        (Target("1", VERSIONS, "", ""), "3", "bad model", "version 1 names no MLflow run"),
        (Target("1", VERSIONS, "r1", ""), "3", "bad model", "run r1 is unknown to this MLflow store"),
        (Target("1", VERSIONS, "r1", "deleted"), "3", "bad model", "run r1 is deleted"),
        (Target("1", VERSIONS, "r1", "active", "FAILED_REGISTRATION"), "3", "x", "version 1 is FAILED_REGISTRATION"),
        (Target("1", VERSIONS, "r1", "active", kept_out="was never champion (x)"), "3", "bad", "version 1 was never"),
    ],
)
def test_refusal(target: Target, champion: str | None, reason: str, refused: str | None) -> None:
    said = refusal(target, champion, reason)
    if refused is None:
        assert said is None
    else:
        assert said is not None and refused in said, said
        assert "--" in said  # names the setting to change


def _move(version: str, previous: str | None) -> ChampionMove:
    return ChampionMove(version, previous, "r", "k", "promote", "better", "training run")


@pytest.mark.parametrize(
    ("moves", "previous", "replaced", "has_served"),
    [
        ([], None, set(), False),
        ([_move("3", "2")], None, set(), True),  # replaced by a recorded move: it was champion (moved there outside)
        ([_move("2", "1")], None, set(), True),  # a recorded move to it
        ([], "2", set(), True),  # previous_champion: an older release's gate, or a person, put it there
        ([], None, {"2"}, True),  # a later version was compared with it as champion
        ([_move("3", "1")], "1", {"1"}, False),
    ],
)
def test_served(moves: list[ChampionMove], previous: str | None, replaced: set[str], has_served: bool) -> None:
    assert served("2", moves, previous, replaced) is has_served


KEPT = {"promotion.decision": "keep_champion", "promotion.reason": "does not beat champion version 1 (0.68 vs 0.94)"}


@pytest.mark.parametrize(
    ("tags", "has_served", "says"),
    [
        (KEPT, False, "was never champion that anything shows: the gate kept it out (does not beat champion version"),
        (KEPT, True, ""),
        ({"promotion.decision": "undecided"}, False, "kept it out (undecided)"),
        ({"promotion.decision": "not_requested"}, False, "kept it out (not_requested)"),
        ({"promotion.decision": "promote"}, False, ""),
        ({"promotion.decision": "replace_incomparable_champion"}, False, ""),
        ({}, False, ""),  # registered by hand: nothing says it did not serve
        ({"promotion.decision": "demote"}, False, "a promotion decision this release does not know ('demote')"),
    ],
)
def test_kept_out(tags: dict[str, str], has_served: bool, says: str) -> None:
    said = kept_out(tags, has_served)
    assert (says in said and said) if says else said == "", said


def _with_champion(tmp_path: Path, name: str) -> tuple[str, Any, list[str]]:
    """Three versions of ``name``; the third is champion, the second previous_champion (as the gate left them)."""
    uri, client, versions = registered_versions(tmp_path, name, 3)
    client.set_registered_model_alias(name, "champion", versions[2])
    client.set_registered_model_alias(name, "previous_champion", versions[1])
    return uri, client, versions


def test_a_rollback_moves_champion_back_and_records_why_and_who(tmp_path: Path) -> None:
    uri, client, (v1, v2, v3) = _with_champion(tmp_path, "rolled")
    move = roll_back(client, "rolled", v1, "v3 mislabels returns", by="rollback by ana@host-1")
    aliases = client.get_registered_model("rolled").aliases
    assert (str(aliases["champion"]), str(aliases["previous_champion"])) == (v1, v3)
    history, champion = read_history(client, "rolled")
    assert history.moves == (move,) and champion == v1
    assert (move.version, move.previous, move.decision) == (v1, v3, ROLLBACK)
    assert (move.reason, move.by, move.run_key) == (
        "v3 mislabels returns",
        "rollback by ana@host-1",
        "20261201-000001-aaaaaa",
    )
    assert move.run_id == client.get_model_version("rolled", v1).run_id
    assert move.note == f"version {v3} was champion before the first recorded move"  # set outside the pipeline
    assert client.search_model_versions(f"name = 'rolled{QUEUE_SUFFIX}'") == []  # its lock ticket released


def _unchanged(client: Any, name: str) -> tuple[dict[str, str], dict[str, str]]:
    model = client.get_registered_model(name)
    return dict(model.aliases), dict(model.tags)


@pytest.mark.parametrize(
    ("to", "reason", "said"),
    [
        ("7", "bad", "version 7 does not exist (its versions: 1, 2, 3)"),
        ("3", "bad", "version 3 is the champion already"),
        ("1", "bad", "is deleted"),  # its run, below
        ("1", "", "needs a reason"),
        ("v1", "bad", "'v1' is not a version number"),
    ],
)
def test_a_refused_rollback_moves_and_records_nothing(tmp_path: Path, to: str, reason: str, said: str) -> None:
    uri, client, (v1, _, _) = _with_champion(tmp_path, "cautious")
    client.delete_run(client.get_model_version("cautious", v1).run_id)
    before = _unchanged(client, "cautious")
    with pytest.raises(RollbackError, match="Nothing moved") as refused:
        roll_back(client, "cautious", to, reason, by="rollback by ana@host-1")
    assert said in str(refused.value) and str(refused.value).startswith("cautious: ")  # names the model
    assert _unchanged(client, "cautious") == before


@pytest.mark.parametrize("reason", ["", " \n"])
def test_a_rollback_without_a_reason_is_refused_before_it_takes_the_lock(tmp_path: Path, reason: str) -> None:
    uri, client, (v1, _, _) = _with_champion(tmp_path, "hasty")
    before = _unchanged(client, "hasty")
    with pytest.raises(RollbackError, match="^hasty: .*needs a reason.*Nothing moved"):
        roll_back(client, "hasty", v1, reason, by="rollback by ana@host-1")
    assert _unchanged(client, "hasty") == before
    assert [m.name for m in client.search_registered_models()] == ["hasty"], "it queued for the lock first"


def test_a_rollback_of_a_model_that_does_not_exist_takes_no_lock(tmp_path: Path) -> None:
    uri, client, _ = registered_versions(tmp_path, "exists", 1)
    with pytest.raises(RollbackError, match="no registered model 'exsits'.*--mlflow-tracking-uri"):
        roll_back(client, "exsits", "1", "typo", by="rollback by ana@host-1")
    assert [m.name for m in client.search_registered_models()] == ["exists"]  # no lock queue made for it


def test_a_rollback_waits_for_the_models_lock(tmp_path: Path) -> None:
    """A register-model deciding on the model holds its lock: the rollback moves nothing until it is released.
    Its ticket says who waits, and where, once."""
    uri, client, (v1, _, v3) = _with_champion(tmp_path, "waits")
    moved: list[Any] = []
    by = f"rollback by ana@{socket.gethostname()}"
    with model_lock(client, "waits", owner="20261201-000009-aaaaaa"):
        rolling = threading.Thread(target=lambda: moved.append(roll_back(client, "waits", v1, "bad", by=by)))
        rolling.start()
        deadline = time.monotonic() + 60
        while len(tickets := client.search_model_versions(f"name = 'waits{QUEUE_SUFFIX}'")) < 2:  # its, behind ours
            assert time.monotonic() < deadline, "the rollback never queued for the lock"
            time.sleep(0.1)
        assert str(client.get_registered_model("waits").aliases["champion"]) == v3 and not moved
        owner = max(tickets, key=lambda ticket: int(ticket.version)).tags["owner"]
        assert owner == f"{by}, to version {v1}", owner
    rolling.join(timeout=60)
    assert moved and str(client.get_registered_model("waits").aliases["champion"]) == v1


def test_a_version_the_gate_kept_out_and_that_never_served_is_refused(tmp_path: Path) -> None:
    uri, client, (v1, _, _) = _with_champion(tmp_path, "gated")
    for key, value in KEPT.items():
        client.set_model_version_tag("gated", v1, key, value)
    before = _unchanged(client, "gated")
    with pytest.raises(RollbackError, match=r"version 1 was never champion that anything shows: the gate kept it"):
        roll_back(client, "gated", v1, "try the small one", by="rollback by ana@host-1")
    assert _unchanged(client, "gated") == before


def test_a_version_the_gate_kept_out_that_served_later_may_be_rolled_back_to(tmp_path: Path) -> None:
    """An older release's history has no record: the previous_champion alias shows the version served."""
    uri, client, (_, v2, v3) = _with_champion(tmp_path, "served")
    for key, value in KEPT.items():
        client.set_model_version_tag("served", v2, key, value)
    move = roll_back(client, "served", v2, "v3 drifts", by="rollback by ana@host-1")
    assert (move.version, move.previous) == (v2, v3)
