"""The services a run starts for itself (a local Ray, Prefect's temporary API) run in process groups of their
own, so that a signal to the run's whole group reaches the run alone and the run stops them in order.

systemd (``KillMode=control-group``), a terminal's Ctrl-C, container inits and Prefect's runner when it cancels a
flow run (``os.killpg(pid, SIGTERM)``, prefect/runner/_process_manager.py) signal every process of a group. Our
services would be in it: they would die first, and the run would then wait on them forever. In a group of
their own they keep running while the run handles the signal (its MLflow run marked KILLED, checkpoints kept),
and the run stops them on its way out: Ray by ``ray.shutdown()`` (and Ray's own fate-sharing, which ends its
processes with this one), the temporary API by Prefect's exit handler. This module holds Ray's door; the
temporary Prefect API's is in flows/temporary_api.py (the driver does not import Prefect).

Neither library has a public switch for this; the door below names the private call it wraps (read from
ray 2.60.0). tests/flows/test_signals.py fails if its shape changes.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_lock = threading.Lock()
# The process groups of the Ray services this process started and has not stopped yet: (the group's id, which is
# its leader's pid; the leader's start time, which tells it from a later process given the same pid).
_groups: list[tuple[int, str]] = []


@contextmanager
def ray_processes_in_their_own_group() -> Iterator[None]:
    """While active, the processes ``ray.init()`` starts (GCS, raylet, dashboard; the raylet's workers follow it)
    begin a session of their own.

    Ray 2.60 starts each with ``ray._private.services.ConsolePopen`` (a ``subprocess.Popen`` subclass) in
    ``start_ray_process``; its ``preexec_fn`` (fate-sharing: the process dies with its parent) still runs.
    """
    from ray._private import services

    original = services.ConsolePopen

    class OwnSessionPopen(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)
            _groups.append((self.pid, _started(self.pid)))

    with _lock:
        services.ConsolePopen = OwnSessionPopen  # type: ignore[misc]
        try:
            yield
        finally:
            services.ConsolePopen = original  # type: ignore[misc]


def ray_groups_stopped() -> None:
    """Ray was shut down (``ray.shutdown()``): its groups are gone, and their ids may be reused."""
    _groups.clear()


def end_ray_groups() -> None:
    """SIGKILL every process group of the Ray services this process started and has not stopped: for an exit
    that cannot wait for ``ray.shutdown()`` (the CLI's stop deadline and its stop by a signal, flows/cli.py).

    Ray's fate-sharing ends the services it started directly when this process dies; their own children (the
    raylet's dashboard and runtime-env agents, its workers) are in the service's group, and were seen to outlive
    it by more than 10 s on a loaded machine. A group whose leader is not the process
    this one started (gone, its pid since given to another) is left alone: when in doubt, nothing is killed.
    """
    for group, started in tuple(_groups):
        if not started or _started(group) != started:
            continue
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone meanwhile
            continue


def _started(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot (Linux's /proc); "" where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""
    # The second field (the command's name, in parentheses) may hold spaces: count from its closing parenthesis.
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else ""
