"""Who was champion when: every move of the ``champion`` alias, kept in the registry itself as one registered-model
tag per move (MLflow keeps no alias history).

    prefect_raytrain.champion.000007 = {"version": "3", "previous": "2", "run_id": ..., "run_key": ...,
                                        "decision": "promote", "reason": ..., "by": ..., "at": "2026-11-24T01:02:03Z"}

A move is recorded after the alias moved, under the model's registry lock, by whoever moved it: register-model
(``raytrain_driver.register``), its next attempt when a kill fell in between, or a rollback
(``raytrain_driver.rollback``). So a record never claims a move that did not happen. A move nobody recorded (the
alias set in the MLflow UI, or a kill before the record) shows in ``history_rows`` as a champion no record
explains, and the next recorded move notes it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from raytrain_driver.origin import VERSION_RUN_KEY_TAG
from raytrain_driver.promotion import CHAMPION, Promotion

if TYPE_CHECKING:
    from mlflow import MlflowClient

TAG_PREFIX = "prefect_raytrain.champion."
_TAG = re.compile(re.escape(TAG_PREFIX) + r"(\d+)$")
ROLLBACK = "rollback"
OUTSIDE = "outside prefect-raytrain (not recorded)"
# A registry's tag values are at most 5000 characters (MLflow's SQL schema): a record stays well below.
REASON_MAX = 1500
DEPLOYMENT_TAG = "prefect.deployment_name"  # on a version registered by a deployment's run (tasks/register.py)


@dataclass(frozen=True)
class ChampionMove:
    """One recorded move of ``champion``: to ``version`` from ``previous`` (None: there was no champion)."""

    version: str
    previous: str | None
    run_id: str
    run_key: str
    decision: str  # the gate's (promote, replace_incomparable_champion) or ``rollback``
    reason: str
    by: str
    at: str = ""  # UTC, ISO 8601; set when recorded
    note: str = ""  # what the history did not explain when it was recorded (a move made outside)
    seq: int = 0  # its place in the history; set when recorded

    def tag_value(self) -> str:
        fields = dataclasses.asdict(self)
        fields.pop("seq")
        fields["reason"] = self.reason[:REASON_MAX]
        return json.dumps(fields, separators=(",", ":"))


@dataclass(frozen=True)
class History:
    """What the registry's tags hold: the moves in order, and the tags that look like records and are not."""

    moves: tuple[ChampionMove, ...]
    unreadable: tuple[str, ...] = ()
    last_seq: int = 0  # the highest number taken, readable or not: a new record never overwrites one


def parse_history(tags: Mapping[str, str]) -> History:
    """The champion records among a registered model's tags, oldest first."""
    moves, unreadable, last = [], [], 0
    for key, value in tags.items():
        if (match := _TAG.match(key)) is None:
            continue
        seq = int(match.group(1))
        last = max(last, seq)
        try:
            fields = json.loads(value)
            moves.append(
                ChampionMove(
                    **{name: fields[name] for name in ("version", "previous", "run_id", "run_key", "decision")},
                    reason=str(fields.get("reason", "")),
                    by=str(fields.get("by", "")),
                    at=str(fields.get("at", "")),
                    note=str(fields.get("note", "")),
                    seq=seq,
                )
            )
        except (ValueError, TypeError, KeyError) as exc:
            unreadable.append(f"{key}: not a champion record ({type(exc).__name__}: {exc})")
    moves.sort(key=lambda move: move.seq)
    return History(tuple(moves), tuple(sorted(unreadable)), last)


def record_key(seq: int) -> str:
    return f"{TAG_PREFIX}{seq:06d}"


def outside_note(moves: Sequence[ChampionMove], previous: str | None) -> str:
    """What a new move from ``previous`` says about the history before it: empty when the last record left
    ``previous`` champion."""
    if not moves:
        return f"version {previous} was champion before the first recorded move" if previous is not None else ""
    last = moves[-1].version
    if previous == last:
        return ""
    now = f"version {previous}" if previous is not None else "no version"
    return f"{now} was champion, not version {last} as last recorded: it was moved outside prefect-raytrain"


def pipeline_mover(version_tags: Mapping[str, str]) -> str:
    """``by`` of a move register-model made: a run of the deployment that ran it (the run key is a field of its
    own)."""
    deployment = version_tags.get(DEPLOYMENT_TAG)
    return f"{deployment} run" if deployment else "training run"


def explains(moves: Sequence[ChampionMove], champion: str) -> bool:
    """Whether the last record made ``champion`` the champion."""
    return bool(moves) and moves[-1].version == champion


def was_champion(moves: Sequence[ChampionMove], version: str) -> bool:
    """Whether a record shows ``champion`` on ``version``: a move to it, or one from it (a rollback that undid it)."""
    return any(version in (move.version, move.previous) for move in moves)


@dataclass(frozen=True)
class HistoryRow:
    """A line of ``prefect-raytrain champions``."""

    at: str
    version: str
    previous: str
    by: str
    run: str
    reason: str


def history_rows(moves: Sequence[ChampionMove], champion_now: str | None) -> list[HistoryRow]:
    """What the history says now, newest first: each recorded move, and a row ``by`` OUTSIDE for each champion no
    record explains (the one now, or one a later record names as the version it replaced)."""
    rows: list[HistoryRow] = []
    recorded_last = moves[-1].version if moves else None
    if champion_now != recorded_last:
        rows.append(_unrecorded(champion_now, recorded_last))
    for index in range(len(moves) - 1, -1, -1):
        move = moves[index]
        rows.append(_row(move))
        before = moves[index - 1].version if index else None
        if index and move.previous != before:
            rows.append(_unrecorded(move.previous, before))
    if moves and moves[0].previous is not None:
        rows.append(_unrecorded(moves[0].previous, None))
    return rows


def _row(move: ChampionMove) -> HistoryRow:
    return HistoryRow(
        at=_shown(move.at),
        version=move.version,
        previous=move.previous or "-",
        by=move.by,
        run=move.run_key or move.run_id or "-",
        reason=move.reason,
    )


def _unrecorded(version: str | None, recorded: str | None) -> HistoryRow:
    how = "the MLflow UI, another tool, or a move whose record was interrupted"
    if version is None:
        reason = f"the {CHAMPION} alias was removed: by {how}"
    elif recorded is None:
        reason = f"champion before any recorded move: made so by {how}, or before prefect-raytrain recorded moves"
    else:
        reason = f"made champion by {how}"
    return HistoryRow(at="?", version=version or "(none)", previous=recorded or "-", by=OUTSIDE, run="-", reason=reason)


def _shown(at: str) -> str:
    try:
        return datetime.fromisoformat(at).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except ValueError:
        return at or "?"


def now_utc() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# --- in the registry (under the model's lock, by whoever moved the alias) -------------------------------------


def read_history(client: MlflowClient, name: str) -> tuple[History, str | None]:
    """The model's recorded moves, and the version ``champion`` names now (None: no champion)."""
    model = client.get_registered_model(name)
    champion = model.aliases.get(CHAMPION)
    return parse_history(dict(model.tags)), None if champion is None else str(champion)


def record_move(client: MlflowClient, name: str, move: ChampionMove) -> ChampionMove:
    """Append ``move`` (just made, under the model's lock) to the history, with the time and what the history
    did not explain before it."""
    history, _ = read_history(client, name)
    recorded = dataclasses.replace(
        move, at=now_utc(), note=outside_note(history.moves, move.previous), seq=history.last_seq + 1
    )
    client.set_registered_model_tag(name, record_key(recorded.seq), recorded.tag_value())
    return recorded


def record_promotion(client: MlflowClient, name: str, version: str, *, unless_explained: bool = False) -> None:
    """Record the gate's move of ``champion`` to ``version`` from the decision its tags hold
    (``raytrain_driver.register.apply_decision`` wrote them before the move). ``unless_explained``: the move of an
    interrupted attempt, finished by the next; not recorded again when the last record already made ``version``
    champion."""
    found = client.get_model_version(name, version)
    tags = dict(found.tags)
    decision = Promotion(tags["promotion.decision"])
    if not decision.moves_champion:  # the alias came to it otherwise (a rollback): that move has its own record
        return
    if unless_explained and explains(read_history(client, name)[0].moves, version):
        return
    move = ChampionMove(
        version=version,
        previous=tags.get("promotion.champion_version") or None,
        run_id=found.run_id or "",
        run_key=tags.get(VERSION_RUN_KEY_TAG, ""),
        decision=decision.value,
        reason=tags.get("promotion.reason", ""),
        by=pipeline_mover(tags),
    )
    record_move(client, name, move)
