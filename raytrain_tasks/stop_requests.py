"""Why a worker group commits a checkpoint at the next step, whatever the checkpoint settings: a SIGTERM to one of
its processes (a spot node shutting down, `kill`), Ray's notice that a node of the group is being drained
(`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`, a cloud's preemption), or
the fit's driver stopping (a SIGTERM to the flow-run process: a Prefect cancellation, a machine shutting down).

A TrainSpec's loop reads these after every step (``trainspec.within_epoch``); a train_func does when it calls
``api.checkpoint_if_preempted`` (the driver's stop excepted). The ranks agree on the step in one all-reduce
(``agreed``), so every rank commits at the same step. After a SIGTERM every rank stops, with StopRequestedError:
Ray Train restarts the group from that checkpoint (one of ``max_failures``), without the process that was told to
go. After a drain notice they commit once and train on, as Ray Train advises: when the node goes, Ray Train
restarts the group from that checkpoint on what remains. After the driver's stop they wait for it to end them,
once it has seen the checkpoint pinned in MLflow.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# After the checkpoint a driver's stop asked for, the workers wait this long for the driver to end them.
DRIVER_ENDS_WITHIN_S = 60.0
# How often each worker asks whether the driver is stopping.
DRIVER_POLL_S = 0.5

# A SIGTERM that the loop has not acted on within this many seconds (a step that never ends, a hung collective)
# ends the process as Ray's own handler would.
SAVE_WITHIN_S = 60.0

_sigterm = threading.Event()
_timers: list[threading.Timer] = []  # the deadline of a SIGTERM not acted on yet
# Whether this process's training code acts on a SIGTERM: a TrainSpec's loop always, a train_func once it has called
# ``checkpoint_if_preempted``. Until then a SIGTERM ends the process at once, as it would without this module.
_acted_on = threading.Event()


class StopRequestedError(RuntimeError):
    """Raised by every rank once the checkpoint a stop asked for is committed: Ray Train restarts the group from it."""


def save_on_sigterm(acted_on: bool = True) -> None:
    """A SIGTERM to this process sets the flag the loop reads after each step, instead of ending the process at
    once; a second SIGTERM, or none acted on within ``SAVE_WITHIN_S``, ends it as the handler before would.
    ``acted_on``: whether the training code reads the flag from the start (False: once it calls
    ``checkpoint_if_preempted``)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _sigterm.clear()
    if acted_on:
        _acted_on.set()
    else:
        _acted_on.clear()
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "saves_first", False):
        return

    def handler(signum: int, frame: Any) -> None:
        if _sigterm.is_set() or not _acted_on.is_set():
            _end_as_before(previous, signum, frame)
            return
        _sigterm.set()
        logger.warning("SIGTERM: committing a checkpoint at the next step, then stopping (pid %d)", os.getpid())
        timer = threading.Timer(SAVE_WITHIN_S, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        _timers.append(timer)
        timer.start()

    handler.saves_first = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, handler)


def _end_as_before(previous: Any, signum: int, frame: Any) -> None:
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        raise SystemExit(128 + signum)


def sigterm_received() -> bool:
    return _sigterm.is_set()


def drain_notice() -> Any:
    """Ray Train's notice that a node of this worker group is being drained (its ``PreemptionInfo``), as this
    worker holds it now; None when there is none. Read from the worker's train context without Ray's collective
    (``ray.train.get_preemption_info()`` is a barrier across the workers through the controller, too slow for every
    step): the ranks agree on it in the loop's own all-reduce. None if Ray's context has another shape."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except (ImportError, AttributeError, RuntimeError):
        return None


class DriverStop:
    """Set by the fit's driver when it is told to stop (a SIGTERM to the flow-run process, Ctrl-C), so that its
    workers commit a checkpoint first: a Ray actor (``driver_stop_actor``) each worker asks every
    ``DRIVER_POLL_S``."""

    def __init__(self) -> None:
        self._asked = False
        self._saved: int | None = None

    def ask(self) -> None:
        self._asked = True

    def asked(self) -> bool:
        return self._asked

    def saved(self, global_step: int) -> None:
        """Rank 0, once the checkpoint the driver asked for is reported: its global step."""
        self._saved = global_step

    def saved_step(self) -> int | None:
        return self._saved


def driver_stop_actor() -> Any:
    """A new ``DriverStop`` actor of no CPU; it ends with the driver's Ray job."""
    import ray

    return ray.remote(num_cpus=0)(DriverStop).remote()


def _watch_driver(handle: Any, asked: threading.Event) -> None:
    """Set ``asked`` once the driver's ``DriverStop`` says so; stop asking once the actor is gone (the driver with
    it: nothing is left to save for)."""
    import ray

    while not asked.is_set():
        try:
            if ray.get(handle.asked.remote(), timeout=10):
                asked.set()
                return
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            continue  # slow or briefly unreachable: ask again
        except ray.exceptions.RayActorError:
            return
        time.sleep(DRIVER_POLL_S)


class StopRequests:
    """What a rank has been asked, as a code for the step's all-reduce (the highest wins on every rank)."""

    NONE, DRAIN, SIGTERM, DRIVER = 0, 1, 2, 3

    def __init__(self, driver_stop: Any = None, rank: int = 0) -> None:
        self.driver_stop = driver_stop
        self.rank = rank
        self.drain_handled = False
        self.driver_asked = threading.Event()
        if driver_stop is not None:
            threading.Thread(
                target=_watch_driver, args=(driver_stop, self.driver_asked), name="driver-stop", daemon=True
            ).start()

    def acted(self, agreed: int) -> None:
        """The ranks agreed to act on a request: a SIGTERM's deadline no longer applies (the commit may be long)."""
        if agreed == self.SIGTERM:
            while _timers:
                _timers.pop().cancel()

    def local(self) -> int:
        if self.driver_asked.is_set():
            return self.DRIVER
        if sigterm_received():
            return self.SIGTERM
        if not self.drain_handled and drain_notice() is not None:
            return self.DRAIN
        return self.NONE

    def after_commit(self, agreed: int, global_step: int | None) -> None:
        """What follows the checkpoint the ranks agreed on: a drain trains on; a SIGTERM raises; the driver's stop
        waits for the driver to end the group. ``global_step``: the checkpoint's (None: unknown, a train_func's)."""
        at = "" if global_step is None else f" at step {global_step}"
        if agreed == self.DRAIN:
            self.drain_handled = True
            logger.warning("a node of this worker group is being drained: checkpoint%s committed", at)
            return
        if agreed == self.DRIVER:
            logger.warning("the driver is stopping: checkpoint%s committed", at)
            if self.driver_stop is not None and self.rank == 0:
                self.driver_stop.saved.remote(global_step)
            time.sleep(DRIVER_ENDS_WITHIN_S)
            raise StopRequestedError(f"the driver asked to stop{at} and did not end the group")
        if agreed == self.SIGTERM:
            raise StopRequestedError(
                f"stopped{at} after a SIGTERM to a worker, its checkpoint committed: Ray Train restarts the worker "
                "group from it"
            )


_own_requests: list[StopRequests] = []  # a train_func's, made by its first call to checkpoint_if_preempted


def checkpoint_if_preempted(save: Callable[[], object]) -> bool:
    """``raytrain_tasks.api.checkpoint_if_preempted``: every rank calls ``save`` at the same step once any rank was
    told to go (a SIGTERM) or Ray drains a node of the group; after a SIGTERM, StopRequestedError follows."""
    _acted_on.set()
    if not _own_requests:
        _own_requests.append(StopRequests())
    requests = _own_requests[0]
    request = requests.local()
    if _distributed():
        _, request = agreed(False, request)
    if not request:
        return False
    requests.acted(request)
    save()
    requests.after_commit(request, None)  # raises after a SIGTERM
    return True


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agreed(due: bool, request: int) -> tuple[bool, int]:
    """(whether any rank's clock says a checkpoint is due, the strongest request any rank has): one all-reduce, on
    every step, so that every rank commits at the same step."""
    import ray.train.torch
    import torch
    import torch.distributed as dist

    values = torch.tensor([int(due), request], dtype=torch.int32, device=ray.train.torch.get_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    agreed_due, agreed_request = values.tolist()
    return bool(agreed_due), int(agreed_request)
