"""One driver per run key: a lease object in the run's storage folder, renewed while the driver lives.

Two drivers on one run key (a manual `resume` while the original still trains, or a duplicate continuation)
would train the same epochs twice and race on checkpoints and the MLflow run. The lease lives next to the
checkpoints (`<storage_path>/runs/<run key>/driver.lease`), so it works for every host that can reach the run
at all. It holds who drives the run and until when; the holder renews it every third of its length. A holder
that dies stops renewing and its lease expires; one on this host that is provably gone is taken over at once.

Storage offers no compare-and-swap through pyarrow, so taking a lease is write, wait, read back: of two drivers
that start within the same moment, the one whose write is read back proceeds and the other is refused.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

from raytrain_tasks.errors import RunLeaseError
from tasks.storage import StorageLocation, make_dirs, remove_empty_dirs

LEASE_FILE = "driver.lease"
SETTLE_S = 0.5

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    holder: str
    expires_at: float

    def describe(self) -> str:
        return f"{self.holder} until {datetime.fromtimestamp(self.expires_at, UTC):%Y-%m-%d %H:%M:%S} UTC"


def read_lease(location: StorageLocation) -> Lease | None:
    """The lease at ``location``, or None when there is none (or it is unreadable: a torn write counts as none)."""
    if not location.exists():
        return None
    try:
        raw = json.loads(location.read_text())
        return Lease(str(raw["holder"]), float(raw["expires_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(location: StorageLocation, lease: Lease) -> None:
    location.write_text(json.dumps({"holder": lease.holder, "expires_at": lease.expires_at}))


@contextmanager
def run_lease(
    run_dir: StorageLocation,
    run_key: str,
    holder: str,
    duration_s: float,
    *,
    holder_alive: Callable[[str], bool | None] = lambda holder: None,
) -> Iterator[None]:
    """Hold the run's lease for the block, renewing it; RunLeaseError when another live driver holds it.

    ``holder_alive``: what this host can tell about a holder (``tasks.tracking.driver_alive``): False (a
    process of this host that is gone) lets its lease be taken over before it runs out; None: cannot tell.
    """
    location = run_dir.child(LEASE_FILE)
    current = read_lease(location)
    if current is not None and current.holder != holder and current.expires_at > time.time():
        if holder_alive(current.holder) is not False:
            raise RunLeaseError(_refusal(run_key, current))
        logger.warning("taking over the lease of run %s from %s: that process is gone", run_key, current.holder)
    created = make_dirs(run_dir)
    _write(location, Lease(holder, time.time() + duration_s))
    time.sleep(SETTLE_S)  # a driver that wrote in the same moment has written by now: read back who won
    won = read_lease(location)
    if won is None or won.holder != holder:
        raise RunLeaseError(_refusal(run_key, won or Lease("another driver", time.time() + duration_s)))
    stop = threading.Event()
    renewer = threading.Thread(
        target=_renew, args=(location, run_key, holder, duration_s, stop), name="run-lease", daemon=True
    )
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join(timeout=10)
        held = read_lease(location)
        if held is not None and held.holder == holder:
            location.filesystem.delete_file(location.path)
        remove_empty_dirs(created)  # a run that never started leaves nothing behind


def _renew(location: StorageLocation, run_key: str, holder: str, duration_s: float, stop: threading.Event) -> None:
    while not stop.wait(duration_s / 3):
        try:
            held = read_lease(location)
            if held is not None and held.holder != holder:
                logger.error("run %s: the lease was taken by %s; this driver stops renewing it", run_key, held.holder)
                return
            _write(location, Lease(holder, time.time() + duration_s))
        except OSError as exc:  # storage briefly unreachable: the next renewal (a third of the lease later) retries
            logger.warning("run %s: could not renew the driver lease (%s); retrying", run_key, exc)


def _refusal(run_key: str, lease: Lease) -> str:
    return (
        f"run {run_key} is being driven by {lease.describe()}: two drivers on one run would train the same epochs "
        "twice. Wait for it to finish; if that process is gone, its lease expires at that time and `resume` works "
        f"then (the lease is {LEASE_FILE} in the run's storage folder)"
    )
