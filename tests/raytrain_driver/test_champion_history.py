"""Who was champion when: the history's rules as tables, and its records kept on a real SQLite registry by the
moves register-model makes (apply_decision, and the repair of a move a kill interrupted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from raytrain_driver.champion_history import (
    OUTSIDE,
    ChampionMove,
    history_rows,
    outside_note,
    parse_history,
    pipeline_mover,
    read_history,
    record_key,
)
from raytrain_driver.promotion import Promotion, PromotionDecision
from raytrain_driver.register import APPLIED_TAG, _decided, apply_decision
from raytrain_driver.registry_lock import QUEUE_SUFFIX, model_lock
from raytrain_driver.rollback import roll_back
from raytrain_tasks.config import TrainingConfig
from tests.registered_versions import registered_versions


def _move(version: str, previous: str | None, seq: int, decision: str = "promote") -> ChampionMove:
    at = f"2026-12-0{seq}T02:00:00Z"
    return ChampionMove(version, previous, f"run{version}", f"key{version}", decision, "why", "by", at, "", seq)


def _tag(move: ChampionMove) -> tuple[str, str]:
    return record_key(move.seq), move.tag_value()


@pytest.mark.parametrize(
    ("tags", "versions", "unreadable", "last_seq"),
    [
        ({}, [], 0, 0),
        ({"owner": "team", "prefect_raytrain.championship": "x"}, [], 0, 0),  # other tags are not records
        (dict([_tag(_move("2", "1", 2)), _tag(_move("1", None, 1))]), ["1", "2"], 0, 2),  # ordered by number
        (dict([_tag(_move("1", None, 1)), _tag(_move("3", "1", 10))]), ["1", "3"], 0, 10),  # 10 after 1, not before
        ({record_key(4): "not json", **dict([_tag(_move("1", None, 1))])}, ["1"], 1, 4),  # a broken one: skipped
        ({record_key(2): json.dumps({"version": "2"})}, [], 1, 2),  # fields missing
    ],
)
def test_parse_history(tags: dict[str, str], versions: list[str], unreadable: int, last_seq: int) -> None:
    history = parse_history(tags)
    assert [move.version for move in history.moves] == versions
    assert len(history.unreadable) == unreadable
    # Its number is taken even when its text cannot be read: a new record never overwrites it.
    assert history.last_seq == last_seq


def test_a_record_reads_back_as_written() -> None:
    move = _move("3", "2", 7, decision="rollback")
    (back,) = parse_history(dict([_tag(move)])).moves
    assert back == move


@pytest.mark.parametrize(
    ("recorded", "previous", "note"),
    [
        ([], None, ""),  # the first champion
        ([], "4", "version 4 was champion before the first recorded move"),
        ([("1", None), ("2", "1")], "2", ""),  # the last record left it champion
        ([("1", None), ("2", "1")], "1", "version 1 was champion, not version 2 as last recorded"),
        ([("1", None)], None, "no version was champion, not version 1 as last recorded"),  # the alias removed
    ],
)
def test_outside_note(recorded: list[tuple[str, str | None]], previous: str | None, note: str) -> None:
    moves = [_move(version, before, seq) for seq, (version, before) in enumerate(recorded, 1)]
    assert outside_note(moves, previous).startswith(note) and bool(note) == bool(outside_note(moves, previous))


@pytest.mark.parametrize(
    ("recorded", "champion_now", "rows"),
    [
        ([], None, []),  # never a champion
        ([], "3", [("3", OUTSIDE)]),  # set by hand, never recorded
        ([("1", None), ("2", "1")], "2", [("2", "by"), ("1", "by")]),  # newest first
        ([("1", None), ("2", "1")], "1", [("1", OUTSIDE), ("2", "by"), ("1", "by")]),  # moved back in the UI
        ([("1", None), ("2", "1")], None, [("(none)", OUTSIDE), ("2", "by"), ("1", "by")]),  # the alias removed
        # Version 5 was made champion outside between two recorded moves: the later one names it as replaced.
        ([("1", None), ("2", "5")], "2", [("2", "by"), ("5", OUTSIDE), ("1", "by")]),
        ([("2", "1")], "2", [("2", "by"), ("1", OUTSIDE)]),  # champion before the history began
    ],
)
def test_history_rows(
    recorded: list[tuple[str, str | None]], champion_now: str | None, rows: list[tuple[str, str]]
) -> None:
    moves = [_move(version, before, seq) for seq, (version, before) in enumerate(recorded, 1)]
    assert [(row.version, row.by) for row in history_rows(moves, champion_now)] == rows


@pytest.mark.parametrize(
    ("tags", "by"),
    [
        ({"run_key": "20261201-020000-abcdef"}, "training run"),  # `prefect-raytrain train`, or a flow called
        ({"run_key": "20261201-020000-abcdef", "prefect.deployment_name": "nightly-retrain"}, "nightly-retrain run"),
        ({"prefect.deployment_name": ""}, "training run"),
    ],
)
def test_pipeline_mover(tags: dict[str, str], by: str) -> None:
    assert pipeline_mover(tags) == by


# --- on a real registry -------------------------------------------------------------------------------------


def _promote(client: MlflowClient, name: str, version: str, over: str | None) -> None:
    """What register-model does once the gate decided to promote ``version`` over ``over``."""
    decision = PromotionDecision(Promotion.PROMOTE, f"beats {over}", 0.9, 0.5 if over else None, over)
    with model_lock(client, name, owner=f"run of {version}") as lock:
        apply_decision(client, name, version, decision, "val_accuracy", lock)


def test_every_move_the_gate_makes_is_recorded_and_a_move_made_outside_shows(tmp_path: Path) -> None:
    uri, client, (v1, v2, v3) = registered_versions(tmp_path, "history", 3)
    _promote(client, "history", v1, None)
    _promote(client, "history", v2, v1)
    history, champion = read_history(client, "history")
    assert champion == v2
    first, second = history.moves
    assert (first.version, first.previous, first.decision, first.reason) == (v1, None, "promote", "beats None")
    assert (second.version, second.previous, second.note) == (v2, v1, "")
    assert second.run_key == "20261201-000002-aaaaaa" and second.by == "training run"
    assert second.run_id == client.get_model_version("history", v2).run_id and second.at.endswith("Z")

    client.set_registered_model_alias("history", "champion", v1)  # someone in the MLflow UI
    history, champion = read_history(client, "history")
    rows = history_rows(history.moves, champion)
    assert (rows[0].version, rows[0].by) == (v1, OUTSIDE)

    _promote(client, "history", v3, v1)  # the next nightly run, decided against the champion it found
    history, champion = read_history(client, "history")
    assert [move.version for move in history.moves] == [v1, v2, v3] and champion == v3
    assert history.moves[-1].note.startswith(f"version {v1} was champion, not version {v2} as last recorded")
    rows = history_rows(history.moves, champion)
    assert [(row.version, row.by == OUTSIDE) for row in rows] == [(v3, False), (v1, True), (v2, False), (v1, False)]
    assert client.search_model_versions(f"name = 'history{QUEUE_SUFFIX}'") == []


@pytest.mark.parametrize("recorded_before_the_kill", [False, True])
def test_a_move_a_kill_interrupted_is_recorded_once_by_the_next_attempt(
    tmp_path: Path, recorded_before_the_kill: bool
) -> None:
    """A kill after `champion` moved and before the decision was marked applied: the next attempt of the run
    finishes the move (register-model's _decided) and records it, unless the killed one already had."""
    uri, client, (v1, v2) = registered_versions(tmp_path, "repaired", 2)
    _promote(client, "repaired", v1, None)
    _promote(client, "repaired", v2, v1)
    # What the kill left: the alias moved, previous_champion not, the decision not marked applied.
    client.delete_registered_model_alias("repaired", "previous_champion")
    client.delete_model_version_tag("repaired", v2, APPLIED_TAG)
    if not recorded_before_the_kill:
        client.delete_registered_model_tag("repaired", record_key(2))
    config = TrainingConfig(model_name="repaired", mlflow_tracking_uri=uri)
    for _attempt in range(2):  # the next attempt, and a resume after it: nothing recorded twice
        with model_lock(client, "repaired", owner="20261201-000002-aaaaaa") as lock:
            ref = _decided(client, config, v2, 0.9, "val_accuracy", lock)
        assert ref is not None and ref.decision == "promote"
    history, champion = read_history(client, "repaired")
    assert [(move.version, move.previous) for move in history.moves] == [(v1, None), (v2, v1)]
    assert champion == v2 and str(client.get_registered_model("repaired").aliases["previous_champion"]) == v1


@pytest.mark.parametrize("recorded_before_the_kill", [False, True])
def test_a_retry_does_not_undo_a_rollback_of_the_move_it_made(tmp_path: Path, recorded_before_the_kill: bool) -> None:
    """A kill after `champion` moved to v2 and before the decision was marked applied, then a rollback to v1: the
    run's next attempt finishes its decision and moves nothing (deciding again could promote v2 over the rollback)."""
    uri, client, (v1, v2) = registered_versions(tmp_path, "rolled", 2)
    _promote(client, "rolled", v1, None)
    _promote(client, "rolled", v2, v1)
    client.delete_model_version_tag("rolled", v2, APPLIED_TAG)
    if not recorded_before_the_kill:  # then only the rollback's record says v2 was champion
        client.delete_registered_model_tag("rolled", record_key(2))
    roll_back(client, "rolled", v1, "v2 mislabels returns", by="rollback by ana@host-1")
    before = client.get_registered_model("rolled")
    config = TrainingConfig(model_name="rolled", mlflow_tracking_uri=uri)
    with model_lock(client, "rolled", owner="20261201-000002-aaaaaa") as lock:
        ref = _decided(client, config, v2, 0.9, "val_accuracy", lock)
    assert ref is not None and ref.decision == "promote", "the retry decides again, over the rollback"
    assert ref.aliases == ("previous_champion",)
    after = client.get_registered_model("rolled")
    assert (after.aliases, after.tags) == (before.aliases, before.tags)  # nothing moved, nothing recorded
    assert client.get_model_version("rolled", v2).tags[APPLIED_TAG] == "true"
