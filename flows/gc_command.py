"""`prefect-raytrain gc` (its flags: flows.command): remove what no run can still need, on this node and in storage
(a dry run unless --apply). The rules are in raytrain_driver.leftovers; what is looked at, and how it is removed,
in raytrain_driver.sweep."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from raytrain_driver.leftovers import Verdict, decide, report
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import StorageError, TrackingError
from raytrain_tasks.redact import redact, redact_uri

PROG = "prefect-raytrain"

if TYPE_CHECKING:
    from raytrain_driver.sweep import Pins


def sweep(config: TrainingConfig, older_than_s: float, apply: bool) -> int:
    """Find, decide, remove (with ``apply``), print; 1 when something could not be removed, 2 without storage."""
    from raytrain_driver.hooks import state_dir
    from raytrain_driver.sweep import find_leftovers, remove
    from raytrain_tasks.storage.locations import locate
    from raytrain_tasks.tracking.pins import pin_journal_dir

    storage = locate(config.storage_path, config.storage_options)
    pins = _pins(config, pin_journal_dir(state_dir()))
    try:
        items, runs = find_leftovers(storage, pins)
    except (OSError, StorageError) as exc:
        print(f"{PROG} gc: cannot read storage {redact_uri(storage.uri)}: {redact(str(exc))}", file=sys.stderr)
        return 2
    decided = [(item, decide(item, runs, older_than_s)) for item in items]
    failed = 0
    if apply:
        for index, (item, verdict) in enumerate(decided):
            if not verdict.remove:
                continue
            try:
                why = remove(item, storage, older_than_s)
            except OSError as exc:
                failed += 1
                why = "could not be removed"
                print(f"{PROG} gc: could not remove {item.where}: {redact(str(exc))}", file=sys.stderr)
            if why:
                decided[index] = (item, Verdict(False, why))
    mode = "removed what no run needs" if apply else "dry run, nothing removed (--apply removes what is listed)"
    print(f"{PROG} gc: {mode}; on {socket.gethostname()} and in {redact_uri(storage.uri)}, older than ", end="")
    print(f"{older_than_s / 3600:g} h")
    if pins.client is None:
        print(f"  MLflow cannot be read ({pins.why}): checkpoint folders and pin journals stay")
    for line in report(decided, apply):
        print(line)
    return 1 if failed else 0


def _pins(config: TrainingConfig, journals: Path) -> Pins:
    """Where the runs' pins are; without a readable MLflow store, a client of None and why."""
    from mlflow.exceptions import MlflowException

    from raytrain_driver.sweep import Pins
    from raytrain_tasks.tracking import runs as tracking

    where = redact_uri(config.mlflow_tracking_uri)
    try:
        client = tracking.existing_store(config.mlflow_tracking_uri, config.s3_endpoint_url)
        if client is None:
            return Pins(None, None, journals, f"no MLflow store at {where}")
        experiment = client.get_experiment_by_name(config.experiment_name)
    except (TrackingError, MlflowException) as exc:
        return Pins(None, None, journals, f"{where}: {redact(str(exc))}"[:300])
    return Pins(client, experiment.experiment_id if experiment is not None else None, journals)
