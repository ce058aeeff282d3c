"""One driver per run key: a lease object in the run's storage folder, renewed while the driver lives.

Two drivers on one run key (a manual `resume` while the original still trains, or a duplicate continuation)
would train the same epochs twice and race on checkpoints and the MLflow run. The lease lives next to the
checkpoints (`<storage_path>/runs/<run key>/driver.lease`), so it works for every host that can reach the run
at all. It holds who drives the run and until when; the holder renews it every third of its length. A holder
that dies stops renewing and its lease expires; one on this host that is provably gone is taken over at once.

Taking and renewing the lease are compare-and-swap writes (``StorageLocation.write_if``: conditional writes on
S3, a folder lock locally): of two drivers that start in the same moment exactly one writes the lease and the
other is refused, and a driver whose lease was taken over cannot renew it.
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

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    holder: str
    expires_at: float

    def describe(self) -> str:
        return f"{self.holder} until {datetime.fromtimestamp(self.expires_at, UTC):%Y-%m-%d %H:%M:%S} UTC"


def read_lease(location: StorageLocation) -> Lease | None:
    """The lease at ``location``, or None when there is none."""
    found = _read(location)
    return found[0] if found else None


def _read(location: StorageLocation) -> tuple[Lease | None, str] | None:
    """(lease, version) of the lease object; the lease is None when the object is unreadable as a lease (writes
    are atomic, so only a foreign or damaged file is): it counts as expired, and is replaced only by a
    compare-and-swap against that very content."""
    found = location.read_versioned()
    if found is None:
        return None
    text, version = found
    try:
        raw = json.loads(text)
        return Lease(str(raw["holder"]), float(raw["expires_at"])), version
    except (ValueError, KeyError, TypeError):
        logger.warning("%s is not a lease this project wrote; it counts as expired", location.uri)
        return None, version


def _encode(holder: str, duration_s: float) -> str:
    return json.dumps({"holder": holder, "expires_at": time.time() + duration_s})


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
    created = make_dirs(run_dir)
    try:
        found = _read(location)
        current, version = found if found else (None, None)
        if current is not None and current.holder != holder and current.expires_at > time.time():
            if holder_alive(current.holder) is not False:
                raise RunLeaseError(_refusal(run_key, current))
            logger.warning("taking over the lease of run %s from %s: that process is gone", run_key, current.holder)
        mine = location.write_if(_encode(holder, duration_s), version)
        if mine is None:  # another driver wrote the lease between our read and our write: it drives
            winner = read_lease(location)
            raise RunLeaseError(_refusal(run_key, winner or Lease("another driver", time.time() + duration_s)))
    except BaseException:
        remove_empty_dirs(created)  # a run that never started leaves nothing behind
        raise
    stop = threading.Event()
    held = _Held(mine)
    renewer = threading.Thread(
        target=_renew, args=(location, run_key, holder, duration_s, held, stop), name="run-lease", daemon=True
    )
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join(timeout=10)
        _release(location, run_key, held, created)


@dataclass
class _Held:
    version: str


def _renew(
    location: StorageLocation, run_key: str, holder: str, duration_s: float, held: _Held, stop: threading.Event
) -> None:
    while not stop.wait(duration_s / 3):
        try:
            renewed = location.write_if(_encode(holder, duration_s), held.version)
        except OSError as exc:  # storage briefly unreachable: the next renewal (a third of the lease later) retries
            logger.warning("run %s: could not renew the driver lease (%s); retrying", run_key, exc)
            continue
        if renewed is None:
            taker = read_lease(location)
            logger.error(
                "run %s: the lease was taken by %s; this driver stops renewing it",
                run_key,
                taker.holder if taker else "another driver",
            )
            return
        held.version = renewed


def _release(location: StorageLocation, run_key: str, held: _Held, created: list[StorageLocation]) -> None:
    """Delete the lease if it is still ours. Storage that cannot be reached now leaves it to expire: the run's
    own outcome (a result, or the error that ended it) matters more than releasing the key early."""
    try:
        found = _read(location)
        if found is not None and found[1] == held.version:  # still ours: release it
            location.filesystem.delete_file(location.path)
        remove_empty_dirs(created)
    except OSError as exc:
        logger.warning(
            "run %s: could not release the driver lease (%s); it expires by itself after run_lease_seconds",
            run_key,
            exc,
        )


def _refusal(run_key: str, lease: Lease) -> str:
    return (
        f"run {run_key} is being driven by {lease.describe()}: two drivers on one run would train the same epochs "
        "twice. Wait for it to finish; if that process is gone, its lease expires at that time and `resume` works "
        f"then (the lease is {LEASE_FILE} in the run's storage folder)"
    )
