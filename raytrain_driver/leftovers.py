"""What `prefect-raytrain gc` may remove: the rules, as a pure decision on what was found.

``raytrain_driver.sweep`` finds the leftovers, with what it could learn about each (its age, whether a process
of this node holds its lock, whether a record still names it, whether its run's lease is held); ``decide`` says
whether it goes, and why. When a fact could not be learned it is None, and the leftover stays. Nothing here
touches a dataset version's content or a checkpoint that Ray Train's record, ``fit.json`` or a pin names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    """A kind of leftover, in the words the command prints."""

    NODE_COPY = "node copies of prepared data"
    PARTIAL_COPY = "unfinished node copies of prepared data"
    CHECKPOINT_STAGING = "checkpoint staging folders"
    UNCOMMITTED_CHECKPOINT = "checkpoint folders never committed"
    INTERRUPTED_WRITE = "files of interrupted writes"
    PIN_JOURNAL = "pin journals"


# The kinds that belong to one run key: never touched while that run's lease is held.
RUN_KINDS = frozenset({Kind.CHECKPOINT_STAGING, Kind.UNCOMMITTED_CHECKPOINT, Kind.PIN_JOURNAL})


@dataclass(frozen=True)
class Leftover:
    """One thing found, and what is known about it. A None fact could not be learned; ``note`` says why."""

    kind: Kind
    where: str  # a local path or a storage URI
    bytes: int
    age_s: float  # since it was last written or, for a node copy, last used
    run_key: str = ""
    in_use: bool | None = False  # a process of this node holds its lock
    listed: bool | None = False  # Ray Train's record or fit.json names this checkpoint; a dataset version holds
    # this file of an interrupted write
    pinned: bool | None = False  # MLflow or this machine's pin journal holds this checkpoint's digest
    unsynced: bool | None = False  # this pin journal holds a pin that MLflow lacks
    note: str = ""


@dataclass(frozen=True)
class RunState:
    """What storage says of a run: ``live`` when its lease is held and unexpired; None when it cannot tell."""

    live: bool | None
    note: str = ""


@dataclass(frozen=True)
class Verdict:
    remove: bool
    why: str  # a short reason, the same words for every leftover it applies to


def decide(item: Leftover, runs: Mapping[str, RunState], older_than_s: float) -> Verdict:
    """Whether ``item`` goes: only what no run can still need, and only once it is older than ``older_than_s``."""
    keep = _why_kept(item, runs)
    if keep:
        return Verdict(False, keep)
    if item.age_s < older_than_s:
        return Verdict(False, "changed within --older-than")
    return Verdict(True, "no run needs it")


def _why_kept(item: Leftover, runs: Mapping[str, RunState]) -> str:
    if item.in_use is None:
        return f"cannot tell whether it is in use ({item.note})"
    if item.in_use:
        return "in use by a process of this node"
    if item.kind in RUN_KINDS or item.run_key:  # an interrupted write in a run's folder is that run's too
        run = runs.get(item.run_key)
        if run is None:
            return "its run is not in this storage_path, so its lease cannot be checked"
        if run.live is None:
            return f"its run's lease cannot be read ({run.note})"
        if run.live:
            return "its run's lease is held"
    if item.kind is Kind.UNCOMMITTED_CHECKPOINT:
        if item.listed is None:
            return f"cannot tell whether the run's records list it ({item.note})"
        if item.listed:
            return "listed in Ray Train's record or fit.json"
        if item.pinned is None:
            return f"cannot tell whether it is pinned ({item.note})"
        if item.pinned:
            return "pinned: committed, though Ray Train's record no longer lists it"
    if item.kind is Kind.INTERRUPTED_WRITE and item.listed is not False:
        return f"it may be part of a dataset version ({item.note})"
    if item.kind is Kind.PIN_JOURNAL:
        if item.unsynced is None:
            return f"cannot tell whether MLflow holds its pins ({item.note})"
        if item.unsynced:
            return "it holds pins that MLflow lacks"
    return ""


def report(decided: Iterable[tuple[Leftover, Verdict]], applied: bool) -> list[str]:
    """The lines the command prints: by kind, what goes (each, with its size) and how many stay, and why."""
    decided = list(decided)
    lines = []
    for kind in Kind:
        mine = [(item, verdict) for item, verdict in decided if item.kind is kind]
        if not mine:
            continue
        going = [item for item, verdict in mine if verdict.remove]
        kept = Counter(verdict.why for _, verdict in mine if not verdict.remove)
        verb = "removed" if applied else "would remove"
        lines.append(f"{kind.value}: {verb} {len(going)} ({size(sum(item.bytes for item in going))})")
        lines += [f"  {item.where}  {size(item.bytes)}" for item in going]
        lines += [f"  kept {count}: {why}" for why, count in sorted(kept.items())]
    total = sum(item.bytes for item, verdict in decided if verdict.remove)
    lines.append(f"{'removed' if applied else 'would remove'} {size(total)} in all")
    return lines


def size(count: int) -> str:
    """``count`` bytes, for people: 512 B, 3.2 KiB, 1.5 GiB."""
    amount = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")
