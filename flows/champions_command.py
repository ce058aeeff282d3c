"""`prefect-raytrain champions NAME` and `prefect-raytrain rollback NAME --to VERSION --reason TEXT` (dispatched
by flows.command): who was champion when, and moving the champion back. The history is kept in the registry
(raytrain_driver.champion_history); the rollback goes through the model's registry lock (raytrain_driver.rollback).
"""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import RollbackError, TrackingError
from raytrain_tasks.redact import redact, redact_uri

PROG = "prefect-raytrain"
COLUMNS = ("time", "version", "previous", "by", "run", "reason")


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{PROG} {command}", description=description)
    parser.add_argument("model_name", metavar="NAME", help="The registered model (`model_name` of its runs).")
    field = TrainingConfig.model_fields["mlflow_tracking_uri"]
    parser.add_argument(
        "--mlflow-tracking-uri", dest="mlflow_tracking_uri", default=field.default, help=field.description
    )
    return parser


def _tracking_uri(args: argparse.Namespace) -> str:
    config = TrainingConfig(mlflow_tracking_uri=args.mlflow_tracking_uri)
    return config.resolved(Path.cwd(), os.environ).mlflow_tracking_uri


def _client(command: str, uri: str) -> Any | None:
    """A client of the store at ``uri``; None (said on stderr) when there is none to read."""
    from raytrain_tasks.tracking import runs as tracking

    try:
        client = tracking.existing_store(uri)
    except TrackingError as exc:
        print(f"{PROG} {command}: {redact(str(exc))}", file=sys.stderr)
        return None
    if client is None:
        print(f"{PROG} {command}: no MLflow store at {redact_uri(uri)}; check --mlflow-tracking-uri", file=sys.stderr)
    return client


def champions(argv: Sequence[str]) -> int:
    """Print the model's champion history, newest first; 2 when there is no such model or store."""
    from mlflow.exceptions import MlflowException

    from raytrain_driver.champion_history import history_rows, read_history

    parser = _parser("champions", "Who was champion when: every move of the model's `champion` alias, newest first.")
    args = parser.parse_args(argv)
    uri = _tracking_uri(args)
    name = args.model_name
    if (client := _client("champions", uri)) is None:
        return 2
    try:
        history, champion = read_history(client, name)
    except MlflowException as exc:
        print(
            f"{PROG} champions: cannot read registered model {name!r} at {redact_uri(uri)}: ", file=sys.stderr, end=""
        )
        print(f"{redact(str(exc))}; check the name and --mlflow-tracking-uri", file=sys.stderr)
        return 2
    for problem in history.unreadable:
        print(f"{PROG} champions: {name}: tag {problem}; left out", file=sys.stderr)
    rows = history_rows(history.moves, champion)
    where = f"{name} at {redact_uri(uri)}"
    if not rows:
        print(f"{where} has no champion history: no version was ever its champion")
        return 0
    print(f"champion history of {where} (champion now: {'version ' + champion if champion else 'none'}):")
    table = [dict(zip(COLUMNS, (r.at, r.version, r.previous, r.by, r.run, r.reason), strict=True)) for r in rows]
    widths = {c: max(len(c), *(len(row[c]) for row in table)) for c in COLUMNS}
    print("  ".join(c.upper().ljust(widths[c]) for c in COLUMNS).rstrip())
    for row in table:
        print("  ".join(row[c].ljust(widths[c]) for c in COLUMNS).rstrip())
    if not history.moves:
        print(f"\nno move of {name}@champion was recorded: prefect-raytrain records the moves it makes")
    return 0


def rollback(argv: Sequence[str]) -> int:
    """Move the champion back; 2 when refused (nothing moved), 1 when the registry failed."""
    parser = _parser(
        "rollback",
        "Move the model's `champion` alias to an earlier version, and `previous_champion` to the one it replaces, "
        "through the model's registry lock; the move is recorded with the reason and who made it.",
    )
    parser.add_argument("--to", dest="to_version", required=True, metavar="VERSION", help="The version to move to.")
    parser.add_argument("--reason", required=True, help="Why: recorded with the move (`champions` lists it).")
    args = parser.parse_args(argv)
    uri = _tracking_uri(args)
    from raytrain_driver.rollback import roll_back

    if (client := _client("rollback", uri)) is None:
        return 2
    try:
        move = roll_back(client, args.model_name, args.to_version, args.reason, by=f"rollback by {who()}")
    except RollbackError as exc:
        print(f"{PROG} rollback: {redact(str(exc))}", file=sys.stderr)
        return 2
    except TrackingError as exc:
        print(f"{PROG} rollback: {redact(str(exc))}", file=sys.stderr)
        return 1
    print(f"{args.model_name}@champion: version {move.previous or 'none'} -> version {move.version}", end="")
    print(f" (previous_champion: {move.previous})" if move.previous else "")
    print(f"recorded as move {move.seq} ({move.by}): `{PROG} champions {args.model_name}` lists it")
    return 0


def who() -> str:
    """user@host of this process (the uid where the user has no name, as in some containers)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"
