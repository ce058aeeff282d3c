"""Moving ``champion`` back to an earlier version by hand, through the same registry lock as register-model, and
recording why (``raytrain_driver.champion_history``).

Fail closed: a version that does not exist, is the champion already, was kept out by the gate and never served, or
whose MLflow run is unknown is refused, and nothing moves.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain_driver.champion_history import ROLLBACK, ChampionMove, parse_history, record_move, was_champion
from raytrain_driver.origin import VERSION_RUN_KEY_TAG
from raytrain_driver.promotion import CHAMPION, PREVIOUS_CHAMPION, Promotion
from raytrain_driver.registry_lock import model_lock
from raytrain_tasks.errors import RollbackError, TrackingError
from raytrain_tasks.settings import MODEL_NAME_PATTERN

if TYPE_CHECKING:
    from mlflow import MlflowClient

# The gate's decision on a version it registered, and why (raytrain_driver.register).
DECISION_TAG = "promotion.decision"
REASON_TAG = "promotion.reason"
CHAMPION_VERSION_TAG = "promotion.champion_version"  # the champion the gate compared the version with
TO_SETTING = "the version to roll back to (`--to`, or the flow's `to_version`)"


@dataclass(frozen=True)
class Target:
    """What the registry says of the version a rollback moves to."""

    version: str
    versions: Collection[str]  # every version of the model
    run_id: str = ""
    run_state: str = ""  # the run's lifecycle stage ("active", "deleted"); empty: MLflow has no such run
    status: str = "READY"
    run_key: str = ""
    kept_out: str = ""  # why nothing shows it served though the gate decided it: kept_out's answer


NO_REASON = "a rollback needs a reason (`--reason`, or the flow's `reason`): it is recorded with the move"


def refusal(target: Target, champion: str | None, reason: str) -> str | None:
    """Why the rollback must not happen; None when it may."""
    if not reason.strip():
        return NO_REASON
    if target.version not in target.versions:
        known = ", ".join(sorted(target.versions, key=int)) or "none"
        return f"version {target.version} does not exist (its versions: {known}); check {TO_SETTING}"
    if target.version == champion:
        return f"version {target.version} is the {CHAMPION} already; check {TO_SETTING}"
    if target.kept_out:
        return (
            f"version {target.version} {target.kept_out}. A rollback returns to a version that served; check "
            f"{TO_SETTING}. If it did serve, move {CHAMPION} to it in the MLflow UI: the next recorded move notes it"
        )
    if target.status != "READY":
        return f"version {target.version} is {target.status}, not READY: it cannot serve; check {TO_SETTING}"
    if not target.run_id:
        return (
            f"version {target.version} names no MLflow run, so nothing says how it was trained; roll back to a "
            f"version a run registered ({TO_SETTING})"
        )
    if target.run_state != "active":
        state = "deleted" if target.run_state else "unknown to this MLflow store"
        return (
            f"version {target.version}'s run {target.run_id} is {state}, so nothing says how it was trained; roll "
            f"back to a version whose run exists ({TO_SETTING}), or restore the run (`mlflow gc` has not run yet)"
        )
    return None


def roll_back(client: MlflowClient, name: str, to_version: str, reason: str, by: str) -> ChampionMove:
    """Move ``champion`` of ``name`` to ``to_version`` and ``previous_champion`` to the one it replaces, under the
    model's lock, and record the move; RollbackError (nothing moved) when ``refusal`` says no."""
    from mlflow.exceptions import MlflowException

    if not re.fullmatch(MODEL_NAME_PATTERN, name):
        raise RollbackError(f"{name!r} is not a registered model name (letters, digits, space, . _ -). Nothing moved")
    version = to_version.strip()
    if not version.isdigit():
        raise RollbackError(f"{name}: {to_version!r} is not a version number; check {TO_SETTING}. Nothing moved")
    version = str(int(version))
    if not reason.strip():  # before the lock: a refusal known up front makes no lock queue
        raise RollbackError(f"{name}: refused to roll back {CHAMPION} to version {version}: {NO_REASON}. Nothing moved")
    try:
        client.get_registered_model(name)  # before the lock: a mistyped name makes no lock queue
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise TrackingError(f"could not read registered model {name}: {exc}. Nothing moved") from exc
        raise RollbackError(
            f"no registered model {name!r} in this MLflow registry; check the model name and `mlflow_tracking_uri` "
            "(--mlflow-tracking-uri). Nothing moved"
        ) from exc
    with model_lock(client, name, owner=f"{by}, to version {version}") as lock:
        try:
            model = client.get_registered_model(name)  # its aliases and, in its tags, the champion history
            aliases = {alias: str(held) for alias, held in model.aliases.items()}
            champion = aliases.get(CHAMPION)
            target = _target(client, name, version, parse_history(dict(model.tags)).moves, aliases)
        except MlflowException as exc:
            raise TrackingError(f"could not read {name} version {version}: {exc}. Nothing moved") from exc
        if (why := refusal(target, champion, reason)) is not None:
            raise RollbackError(f"{name}: refused to roll back {CHAMPION} to version {version}: {why}. Nothing moved")
        lock.check()  # never move an alias on a lock that was taken over
        move = ChampionMove(version, champion, target.run_id, target.run_key, ROLLBACK, reason.strip(), by)
        try:
            client.set_registered_model_alias(name, CHAMPION, version)
            if champion is not None:
                client.set_registered_model_alias(name, PREVIOUS_CHAMPION, champion)
        except MlflowException as exc:
            raise TrackingError(
                f"could not move {name}'s aliases ({CHAMPION} to version {version}, {PREVIOUS_CHAMPION} to "
                f"{champion or 'none'}): {exc}. `prefect-raytrain champions {name}` shows where {CHAMPION} is now"
            ) from exc
        try:
            return record_move(client, name, move)
        except MlflowException as exc:
            raise TrackingError(
                f"{name}@{CHAMPION} moved to version {version} (from {champion or 'none'}), but the move could not be "
                f"recorded: {exc}. `prefect-raytrain champions {name}` shows it as moved outside prefect-raytrain"
            ) from exc


def served(version: str, moves: Sequence[ChampionMove], previous_champion: str | None, replaced: Set[str]) -> bool:
    """Whether anything shows ``version`` was champion: a recorded move to or from it, the ``previous_champion``
    alias on it, or a gate decision that compared a candidate with it as champion (``replaced``: every version's
    ``promotion.champion_version``; the gate wrote those before the history was recorded)."""
    return was_champion(moves, version) or version == previous_champion or version in replaced


def kept_out(version_tags: Mapping[str, str], has_served: bool) -> str:
    """What refuses a rollback to a version the gate decided without making it champion, where nothing shows it
    served since (a move in the MLflow UI leaves no record until the next one); "" otherwise, and for a version
    the gate never decided (registered by hand)."""
    decision = version_tags.get(DECISION_TAG)
    if not decision or has_served:
        return ""
    try:
        if Promotion(decision).moves_champion:
            return ""
    except ValueError:  # a decision this release does not know: it cannot tell, so it refuses
        return f"has a promotion decision this release does not know ({decision!r}), and nothing shows it served"
    reason = (version_tags.get(REASON_TAG) or decision)[:300]
    return f"was never {CHAMPION} that anything shows: the gate kept it out ({reason})"


def _target(
    client: MlflowClient, name: str, version: str, moves: Sequence[ChampionMove], aliases: Mapping[str, str]
) -> Target:
    from mlflow.exceptions import MlflowException

    every = client.search_model_versions(f"name = '{name}'")
    versions = {str(found.version) for found in every}
    replaced = {str(dict(found.tags).get(CHAMPION_VERSION_TAG)) for found in every}
    if version not in versions:
        return Target(version, versions)
    found = client.get_model_version(name, version)
    run_id = found.run_id or ""
    state = ""
    if run_id:
        try:
            state = client.get_run(run_id).info.lifecycle_stage
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
    tags = dict(found.tags)
    run_key = tags.get(VERSION_RUN_KEY_TAG, "")
    has_served = served(version, moves, aliases.get(PREVIOUS_CHAMPION), replaced)
    return Target(version, versions, run_id, state, str(found.status), run_key, kept_out(tags, has_served))
