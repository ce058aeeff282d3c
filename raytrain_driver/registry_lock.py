"""A lock per registered model, kept in the MLflow registry itself, so any pipeline that can register can take it.

Each contender takes a *ticket*: a model version of ``<model>.promotion-queue``. The registry numbers versions
atomically, so tickets are totally ordered; the holder is the oldest live ticket. A holder renews its ticket's
``heartbeat`` tag every ``lease_s / 4`` seconds from a thread of its own. A waiter judges an older ticket dead
when it has watched the heartbeat stand still for ``lease_s`` on *its own* monotonic clock (no clocks of
different hosts are compared), and then deletes that ticket, which nobody else can own: two waiters that both
judge it dead delete the same ticket, never each other's. Releasing deletes one's own ticket only.

What a lease cannot rule out: a holder frozen for longer than ``lease_s`` (a stopped VM) is taken over while it
still believes it holds the lock. ``LockHandle.check`` lets the holder verify, right before it moves an alias,
that its ticket still exists, and fail closed otherwise.
"""

from __future__ import annotations

import logging
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain_tasks.errors import TrackingError
from raytrain_tasks.tracking import runs as tracking

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

QUEUE_SUFFIX = ".promotion-queue"
LEASE_S = 60.0
WAIT_S = 900.0
# A ticket points at no artifacts, but a tracking server accepts only an absolute artifact URI as a source.
TICKET_SOURCE = "prefect-raytrain://promotion-queue/ticket"
# Errors another attempt cannot fix: they end the wait at once.
PERMANENT_ERRORS = frozenset(
    {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_DOES_NOT_EXIST"}
)


@dataclass
class LockHandle:
    client: MlflowClient
    queue: str
    ticket: str
    owner: str

    def check(self) -> None:
        """Raise TrackingError unless this holder's ticket still exists (it was not taken over)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_model_version(self.queue, self.ticket)
        except MlflowException as exc:
            raise TrackingError(
                f"lost the promotion lock {self.queue} (ticket {self.ticket} of run {self.owner}) before registering "
                f"a version or moving an alias: {exc}. Nothing was registered or moved; retry the run to redo the "
                "decision"
            ) from exc


@contextmanager
def model_lock(
    client: MlflowClient,
    model_name: str,
    owner: str,
    *,
    lease_s: float | None = None,
    wait_s: float = WAIT_S,
) -> Iterator[LockHandle]:
    """Hold the lock of ``model_name`` for the block; TrackingError if not had within ``wait_s``.

    ``lease_s`` defaults to ``LEASE_S`` as it is when called. It is not a setting: every pipeline of a model
    must judge heartbeats by the same lease, or a short one would take over a live holder's lock."""
    lease_s = LEASE_S if lease_s is None else lease_s
    queue = f"{model_name}{QUEUE_SUFFIX}"
    deadline = time.monotonic() + wait_s
    ticket = _retrying(lambda: _take_ticket(client, queue, owner), deadline, f"take a ticket in {queue!r}")
    handle = LockHandle(client, queue, ticket, owner)
    stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeat, args=(client, queue, ticket, lease_s / 4, stop), name="promotion-lock", daemon=True
    )
    beat.start()
    try:
        with tracking.releasing_interrupted_reads():  # the ticket's deletion below writes to the registry
            _wait_for_turn(client, queue, ticket, lease_s, deadline, wait_s)
            yield handle
    finally:
        stop.set()
        beat.join(timeout=lease_s)
        _delete_ticket(client, queue, ticket)


def _take_ticket(client: MlflowClient, queue: str, owner: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(queue, description="Tickets of pipelines waiting to decide the champion.")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    holder = ticket_owner(owner, socket.gethostname())
    version = client.create_model_version(queue, source=TICKET_SOURCE, tags={"owner": holder, "heartbeat": "0"})
    return str(version.version)


def ticket_owner(owner: str, host: str) -> str:
    """A ticket's ``owner`` tag: ``owner`` on ``host``, unless it names that host already (``user@host``)."""
    if re.search(rf"(?<![\w.-]){re.escape(host)}(?![\w.-])", owner):
        return owner
    return f"{owner} on {host}"


def _wait_for_turn(
    client: MlflowClient, queue: str, ticket: str, lease_s: float, deadline: float, wait_s: float
) -> None:
    watched: dict[str, tuple[str, float]] = {}  # ticket -> (heartbeat last seen, when it last changed)
    while True:
        tickets = _retrying(lambda: _tickets(client, queue), deadline, f"read the tickets of {queue!r}")
        ahead = {version: tags for version, tags in tickets.items() if int(version) < int(ticket)}
        if not ahead:
            return
        now = time.monotonic()
        for version, tags in ahead.items():
            beat = tags.get("heartbeat", "")
            seen = watched.get(version)
            if seen is None or seen[0] != beat:
                watched[version] = (beat, now)
            elif now - seen[1] >= lease_s:
                logger.warning(
                    "promotion lock %s: ticket %s of %s has not renewed for %.0fs; taking it over",
                    queue,
                    version,
                    tags.get("owner", "?"),
                    now - seen[1],
                )
                _delete_ticket(client, queue, version)
        if now > deadline:
            oldest = min(ahead, key=int)
            raise TrackingError(
                f"waited {wait_s:.0f}s for the promotion lock {queue!r}, held by "
                f"{ahead[oldest].get('owner', '?')} (ticket {oldest}), which is still renewing it; try again later"
            )
        time.sleep(min(2.0, lease_s / 8) * (0.5 + random.random()))


def _tickets(client: MlflowClient, queue: str) -> dict[str, dict[str, str]]:
    return {str(v.version): dict(v.tags) for v in client.search_model_versions(f"name = '{queue}'")}


def _heartbeat(client: MlflowClient, queue: str, ticket: str, every_s: float, stop: threading.Event) -> None:
    count = 0
    while not stop.wait(every_s):
        count += 1
        try:
            client.set_model_version_tag(queue, ticket, "heartbeat", str(count))
        except Exception:  # noqa: BLE001 - a missed beat is retried; the holder checks its ticket before acting
            logger.warning("could not renew promotion ticket %s of %s", ticket, queue, exc_info=True)


def _delete_ticket(client: MlflowClient, queue: str, ticket: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.delete_model_version(queue, ticket)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":  # already taken over, or deleted by another waiter
            logger.warning("could not delete promotion ticket %s of %s: %s", ticket, queue, exc)


def _retrying(call, deadline: float, what: str):  # type: ignore[no-untyped-def]
    """``call()``, retried with backoff while the registry errors, until ``deadline``."""
    from mlflow.exceptions import MlflowException

    delay = 0.5
    while True:
        try:
            return call()
        except (MlflowException, OSError) as exc:
            permanent = isinstance(exc, MlflowException) and exc.error_code in PERMANENT_ERRORS
            if permanent or time.monotonic() + delay > deadline:
                raise TrackingError(f"could not {what} in the MLflow registry: {exc}") from exc
            logger.warning("could not %s (%s); retrying in %.1fs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 15.0)
