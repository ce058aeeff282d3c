"""One driver per run key: a lease object in the run's storage folder, renewed while the driver lives.

Two drivers on one run key (a manual `resume` while the original still trains, or a duplicate continuation)
would train the same epochs twice and race on checkpoints and the MLflow run. The lease lives next to the
checkpoints (`<storage_path>/runs/<run key>/driver.lease`), so it works for every host that can reach the run
at all. It names the driver that holds it and how long it lasts unrenewed; the holder renews it every third of
its length (a failed renewal is retried every twelfth). A holder that dies stops renewing and its lease expires;
one on this host that is provably gone is taken over at once.

Expiry is judged without any other host's clock: a lease counts as expired when the storage says it was last
written more than its length ago (S3's ``LastModified`` against the same reply's ``Date``; on a network
filesystem the file's mtime against a probe's, both from the file server). The holder, on its
own monotonic clock, counts itself as having lost the lease when it has had no successful renewal for
``LOST_AFTER`` of the length, before anyone else can see it expired, or as soon as a renewal finds it taken; the
block under the lease must then stop at once (``HeldLease.check``; ``raytrain_driver.fit`` kills the Ray Train
controller).

Taking, renewing and releasing the lease are compare-and-swap operations (``StorageLocation.write_if`` and
``delete_if``: conditional requests on S3, otherwise a folder lock that every host sees): of two drivers that
start in the same moment exactly one writes the lease and the other is refused, and a driver whose lease was taken
over can neither renew nor delete it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

from raytrain_tasks.errors import RunLeaseError, RunLeaseLostError
from raytrain_tasks.storage.locations import StorageLocation, make_dirs, remove_empty_dirs

LEASE_FILE = "raytrain_driver.lease"
# The holder gives the lease up after this share of its length without a successful renewal: the rest is the
# time it has to stop its fit before any other driver can see the lease expired.
LOST_AFTER = 0.75
WATCH_INTERVAL_S = 0.2  # how often the lease's clock is read while a block runs
RETRIES_PER_LEASE = 12  # a failed renewal is tried again after 1/12 of the lease
# Tries per lease request: the renewer retries on its own schedule and must notice a lost lease in time, so one
# request never waits through s3_max_attempts' minute of backoff.
REQUEST_ATTEMPTS = 2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    holder: str
    duration_s: float  # how long it lasts unrenewed
    age_s: float = 0.0  # since its last renewal, by the storage's clock
    renewals: int = 0

    @property
    def remaining_s(self) -> float:
        return self.duration_s - self.age_s

    def describe(self) -> str:
        until = datetime.fromtimestamp(time.time() + max(0.0, self.remaining_s), UTC)
        return f"{self.holder} until {until:%Y-%m-%d %H:%M:%S} UTC (unless renewed; renewal {self.renewals})"


def read_lease(location: StorageLocation) -> Lease | None:
    """The lease at ``location``, or None when there is none."""
    found = _read(location, 0.0)
    return found[0] if found else None


def _read(location: StorageLocation, default_duration_s: float) -> tuple[Lease | None, str] | None:
    """(lease, version) of the lease object; the lease is None when the object is unreadable as a lease (writes
    are atomic, so only a foreign or damaged file is): it counts as expired, and is replaced only by a
    compare-and-swap against that very content. A lease from an older release has no length of its own: it
    lasts ``default_duration_s`` from its last write."""
    found = location.read_aged(REQUEST_ATTEMPTS)
    if found is None:
        return None
    try:
        raw = json.loads(found.text)
        lease = Lease(
            str(raw["holder"]),
            float(raw.get("duration_s", default_duration_s)),
            max(0.0, found.age_s),
            int(raw.get("renewals", 0)),
        )
        return lease, found.version
    except (ValueError, KeyError, TypeError, AttributeError):
        logger.warning("%s is not a lease this project wrote; it counts as expired", location.uri)
        return None, found.version


def _encode(holder: str, duration_s: float, renewals: int) -> str:
    # expires_at is for people reading the file: by the writer's clock, never compared by another driver.
    return json.dumps(
        {"holder": holder, "duration_s": duration_s, "renewals": renewals, "expires_at": time.time() + duration_s}
    )


@dataclass
class HeldLease:
    """The lease as its holder sees it; ``check`` raises RunLeaseLostError once it is lost."""

    location: StorageLocation
    run_key: str
    holder: str
    duration_s: float
    version: str
    renewed_at: float  # monotonic time the last successful write was sent
    renewals: int = 0
    taken_by: str | None = None
    lost_event: threading.Event = field(default_factory=threading.Event)
    _why: str | None = None

    def lost(self) -> str | None:
        """Why this driver no longer holds the lease; None while it does. Once lost, it stays lost."""
        if self._why is None:
            unrenewed = time.monotonic() - self.renewed_at
            if self.taken_by is not None:
                self._why = f"the lease was taken by {self.taken_by}"
            elif unrenewed > LOST_AFTER * self.duration_s:
                self._why = (
                    f"it could not be renewed for {unrenewed:.0f} s (storage unreachable?), and after "
                    f"{self.duration_s:g} s another driver may take it over"
                )
            else:
                return None
            self.lost_event.set()
        return self._why

    def check(self) -> None:
        """Raise RunLeaseLostError when the lease is lost: the caller must stop driving the run now."""
        why = self.lost()
        if why is not None:
            raise RunLeaseLostError(
                f"driver {self.holder} lost the lease of run {self.run_key}: {why}. It stopped its fit so that two "
                f"drivers never train the run at once; the run belongs to the lease's holder now (or, once the lease "
                f"has expired, to `resume={self.run_key}`). Raise `run_lease_seconds` if storage outages this long "
                "are expected"
            )


@contextmanager
def run_lease(
    run_dir: StorageLocation,
    run_key: str,
    holder: str,
    duration_s: float,
    *,
    holder_alive: Callable[[str], bool | None] = lambda holder: None,
) -> Iterator[HeldLease]:
    """Hold the run's lease for the block, renewing it; RunLeaseError when another live driver holds it.

    The block must call ``check()`` on what it gets often (or watch ``lost_event``): a lease lost mid-block is
    not taken back, and the block must stop driving the run.

    ``holder_alive``: what this host can tell about a holder
    (``raytrain_tasks.tracking.run_owner.driver_alive``): False (a
    process of this host that is gone) lets its lease be taken over before it runs out; None: cannot tell.
    """
    location = run_dir.child(LEASE_FILE)
    created = make_dirs(run_dir)
    try:
        found = _read(location, duration_s)
        current, version = found if found else (None, None)
        if current is not None and current.holder != holder and current.remaining_s > 0:
            if holder_alive(current.holder) is not False:
                raise RunLeaseError(_refusal(run_key, current))
            logger.warning("taking over the lease of run %s from %s: that process is gone", run_key, current.holder)
        sent = time.monotonic()
        mine = location.write_if(_encode(holder, duration_s, 0), version, REQUEST_ATTEMPTS)
        if mine is None and (landed := _own_write(location, holder, 0)) is not None:
            mine, sent = landed  # our own write, whose reply was lost
        if mine is None:  # another driver wrote the lease between our read and our write: it drives
            winner = read_lease(location)
            raise RunLeaseError(_refusal(run_key, winner or Lease("another driver", duration_s)))
    except BaseException:
        remove_empty_dirs(created)  # a run that never started leaves nothing behind
        raise
    stop = threading.Event()
    held = HeldLease(location, run_key, holder, duration_s, mine, sent)
    renewer = threading.Thread(target=_renew, args=(held, stop), name="run-lease", daemon=True)
    renewer.start()
    # The renewer can sit in one storage call for seconds (retries against a dead endpoint); the watch sets
    # lost_event at LOST_AFTER on the clock alone, whatever that call is doing.
    watch = threading.Thread(target=_watch, args=(held, stop), name="run-lease-watch", daemon=True)
    watch.start()
    try:
        yield held
    finally:
        stop.set()
        renewer.join(timeout=10)
        _release(held, created)


def _watch(held: HeldLease, stop: threading.Event) -> None:
    while not stop.wait(WATCH_INTERVAL_S) and held.lost() is None:
        pass


def renewal_due_in(held: HeldLease) -> float:
    """Seconds until the next renewal: a third of the lease after the last write known to have landed, whenever
    its confirmation came. A write confirmed late (a lost reply found landed, a slow call) is dated when it was
    sent, so waiting a full third from the confirmation would leave less than the lease's margin."""
    return max(0.0, held.renewed_at + held.duration_s / 3 - time.monotonic())


def _renew(held: HeldLease, stop: threading.Event) -> None:
    delay = renewal_due_in(held)
    while not stop.wait(delay):
        sent = time.monotonic()
        try:
            renewed = held.location.write_if(
                _encode(held.holder, held.duration_s, held.renewals + 1), held.version, REQUEST_ATTEMPTS
            )
        except OSError as exc:  # storage briefly unreachable: retried soon, until the lease counts as lost
            delay = held.duration_s / RETRIES_PER_LEASE
            if held.lost() is not None:
                logger.error(
                    "run %s: could not renew the driver lease in time (%s); this driver stops", held.run_key, exc
                )
                return
            logger.warning(
                "run %s: could not renew the driver lease (%s); retrying in %.1f s", held.run_key, exc, delay
            )
            continue
        if renewed is None:
            landed = _own_write(held.location, held.holder, held.renewals + 1)
            if landed is None:
                try:
                    taker = read_lease(held.location)
                except OSError:
                    taker = None
                held.taken_by = taker.holder if taker else "another driver"
                held.lost()
                logger.error("run %s: the lease was taken by %s; this driver stops", held.run_key, held.taken_by)
                return
            renewed, sent = landed
        if held.lost() is not None:  # renewed too late: the block is stopping already, and stays stopped
            held.version = renewed  # still ours to release
            return
        held.version, held.renewed_at, held.renewals = renewed, sent, held.renewals + 1
        delay = renewal_due_in(held)


def _own_write(location: StorageLocation, holder: str, renewals: int) -> tuple[str, float] | None:
    """After a compare-and-swap refused: (version, monotonic time it was written) when the lease there is this
    holder's write number ``renewals`` all the same, else None. An earlier try of the same write landed and its
    reply was lost (a cut connection; botocore then retries, or the next renewal runs): the version moved under
    us, by our own hand. Its time is the storage's age of it, less a second for S3's whole-second clock."""
    try:
        found = _read(location, 0.0)
    except OSError:
        return None
    lease, version = found if found else (None, "")
    if lease is None or lease.holder != holder or lease.renewals != renewals:
        return None
    return version, time.monotonic() - lease.age_s - 1.0


def _release(held: HeldLease, created: list[StorageLocation]) -> None:
    """Delete the lease if it is still ours (a conditional delete: a lease taken over meanwhile stays). Storage
    that cannot be reached now leaves it to expire: the run's own outcome (a result, or the error that ended it)
    matters more than releasing the key early."""
    try:
        if held.taken_by is None:
            held.location.delete_if(held.version, REQUEST_ATTEMPTS)
        remove_empty_dirs(created)
    except OSError as exc:
        logger.warning(
            "run %s: could not release the driver lease (%s); it expires by itself after run_lease_seconds",
            held.run_key,
            exc,
        )


def _refusal(run_key: str, lease: Lease) -> str:
    return (
        f"run {run_key} is being driven by {lease.describe()}: two drivers on one run would train the same epochs "
        "twice. Wait for it to finish; if that process is gone, its lease expires at that time and `resume` works "
        f"then (the lease is {LEASE_FILE} in the run's storage folder)"
    )
