"""What `prefect-raytrain gc` removes (raytrain_driver.leftovers.decide): only what no run can still need, only once
it is older than --older-than; whatever could not be learned keeps it. A table of found leftovers; no folders."""

from __future__ import annotations

from typing import Any

import pytest

from raytrain_driver.leftovers import Kind, Leftover, RunState, Verdict, decide, report

DAY = 24 * 3600.0
LIVE, DONE, UNREADABLE, ELSEWHERE = "20261127-080000-aaaaaa", "20261127-080000-bbbbbb", "20261127-080000-cccccc", ""
RUNS = {LIVE: RunState(True), DONE: RunState(False), UNREADABLE: RunState(None, "storage timed out")}


def item(kind: Kind, age_s: float = 2 * DAY, run_key: str = DONE, **facts: Any) -> Leftover:
    return Leftover(kind, f"/somewhere/{kind.name.lower()}", 1000, age_s, run_key, **facts)


CASES = [
    # A node copy of prepared data: goes when no process of the node holds its locks and it is not recently used.
    (item(Kind.NODE_COPY), True, "no run needs it"),
    (item(Kind.NODE_COPY, in_use=True), False, "in use by a process of this node"),
    (item(Kind.NODE_COPY, in_use=None, note="EACCES"), False, "cannot tell whether it is in use (EACCES)"),
    (item(Kind.NODE_COPY, age_s=DAY / 2), False, "changed within --older-than"),
    (item(Kind.PARTIAL_COPY, in_use=True), False, "in use by a process of this node"),
    (item(Kind.PARTIAL_COPY), True, "no run needs it"),
    # A checkpoint staging folder belongs to its run: kept while that run's lease is held, or cannot be read.
    (item(Kind.CHECKPOINT_STAGING), True, "no run needs it"),
    (item(Kind.CHECKPOINT_STAGING, run_key=LIVE), False, "its run's lease is held"),
    (item(Kind.CHECKPOINT_STAGING, run_key=UNREADABLE), False, "its run's lease cannot be read (storage timed out)"),
    (
        item(Kind.CHECKPOINT_STAGING, run_key=ELSEWHERE),
        False,
        "its run is not in this storage_path, so its lease cannot be checked",
    ),
    # A checkpoint folder: never one Ray Train's record or fit.json lists, nor one pinned; unknowns keep it.
    (item(Kind.UNCOMMITTED_CHECKPOINT), True, "no run needs it"),
    (item(Kind.UNCOMMITTED_CHECKPOINT, listed=True), False, "listed in Ray Train's record or fit.json"),
    (
        item(Kind.UNCOMMITTED_CHECKPOINT, listed=None, note="bad JSON"),
        False,
        "cannot tell whether the run's records list it (bad JSON)",
    ),
    (
        item(Kind.UNCOMMITTED_CHECKPOINT, pinned=True),
        False,
        "pinned: committed, though Ray Train's record no longer lists it",
    ),
    (
        item(Kind.UNCOMMITTED_CHECKPOINT, pinned=None, note="MLflow down"),
        False,
        "cannot tell whether it is pinned (MLflow down)",
    ),
    (item(Kind.UNCOMMITTED_CHECKPOINT, run_key=LIVE), False, "its run's lease is held"),
    (item(Kind.UNCOMMITTED_CHECKPOINT, age_s=60), False, "changed within --older-than"),
    # A file of an interrupted write: goes unless a dataset version may hold it.
    (item(Kind.INTERRUPTED_WRITE, run_key=ELSEWHERE), True, "no run needs it"),
    (
        item(Kind.INTERRUPTED_WRITE, run_key=ELSEWHERE, listed=None, note="no marker"),
        False,
        "it may be part of a dataset version (no marker)",
    ),
    (item(Kind.INTERRUPTED_WRITE, age_s=60), False, "changed within --older-than"),
    # One in a run's folder (a lease or fit.json being replaced) is that run's: kept while its lease is held.
    (item(Kind.INTERRUPTED_WRITE, run_key=LIVE, age_s=2 * DAY), False, "its run's lease is held"),
    # A pin journal: goes once MLflow holds every pin in it, and its run is not live.
    (item(Kind.PIN_JOURNAL), True, "no run needs it"),
    (item(Kind.PIN_JOURNAL, unsynced=True), False, "it holds pins that MLflow lacks"),
    (
        item(Kind.PIN_JOURNAL, unsynced=None, note="MLflow down"),
        False,
        "cannot tell whether MLflow holds its pins (MLflow down)",
    ),
    (item(Kind.PIN_JOURNAL, run_key=LIVE), False, "its run's lease is held"),
    (
        item(Kind.PIN_JOURNAL, run_key=ELSEWHERE),
        False,
        "its run is not in this storage_path, so its lease cannot be checked",
    ),
]


@pytest.mark.parametrize(("found", "goes", "why"), CASES, ids=[f"{c[0].kind.name}-{c[2][:40]}" for c in CASES])
def test_what_goes_and_why(found: Leftover, goes: bool, why: str) -> None:
    assert decide(found, RUNS, older_than_s=DAY) == Verdict(goes, why)


def test_the_report_lists_what_goes_with_its_size_and_counts_what_stays_by_reason() -> None:
    decided = [
        (item(Kind.NODE_COPY), Verdict(True, "no run needs it")),
        (item(Kind.NODE_COPY), Verdict(False, "in use by a process of this node")),
        (item(Kind.PIN_JOURNAL), Verdict(False, "it holds pins that MLflow lacks")),
    ]
    assert report(decided, applied=False) == [
        "node copies of prepared data: would remove 1 (1000 B)",
        "  /somewhere/node_copy  1000 B",
        "  kept 1: in use by a process of this node",
        "pin journals: would remove 0 (0 B)",
        "  kept 1: it holds pins that MLflow lacks",
        "would remove 1000 B in all",
    ]
