"""Which process drives an MLflow run (its DRIVER_TAG), whether that process still lives, and the runs whose driver
died without ending them (marked KILLED)."""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

DRIVER_TAG = "prefect_raytrain.driver"
KILLED_TAG = "prefect_raytrain.killed"


def this_driver() -> str:
    """``host@scope:pid:start`` of this process. The scope names the process table the pid is in (the kernel's
    boot and the pid namespace), so two containers with the same hostname are told apart; the start time tells a
    reused pid from the original."""
    return f"{socket.gethostname()}@{_pid_scope()}:{os.getpid()}:{_process_start(os.getpid())}"


def driver_alive(driver: str) -> bool | None:
    """Whether the process a DRIVER_TAG names still runs; None when this process cannot tell (another host or
    container, or a tag without a scope, from an older release)."""
    host, _, rest = driver.partition(":")
    pid, _, start = rest.partition(":")
    if host != f"{socket.gethostname()}@{_pid_scope()}" or not pid.isdigit() or not start:
        return None
    return _process_start(int(pid)) == start


@functools.cache
def _pid_scope() -> str:
    """What makes this process's pids its own: the kernel's boot id and the pid namespace (Linux). Where either
    cannot be read, a random token: no other process then shares the scope, and nobody judges this one dead."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            identity = boot.read().strip() + os.readlink("/proc/self/ns/pid")
    except OSError:
        return secrets.token_hex(6)
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def mark_dead_runs_killed(client: MlflowClient, experiment_id: str, found_by: str) -> list[str]:
    """Mark KILLED the experiment's RUNNING runs whose driver process on this host is gone; returns their ids.

    A killed process cannot mark its own run. Runs driven from other hosts are left alone: from here
    nobody can tell whether they still train.
    """
    from datetime import UTC, datetime

    killed = []
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=200):
        driver = run.data.tags.get(DRIVER_TAG, "")
        if driver_alive(driver) is not False:
            continue
        reason = (
            f"driver process {driver} ended without finishing this run; marked KILLED by run {found_by} at "
            f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}"
        )
        client.set_tag(run.info.run_id, KILLED_TAG, reason)
        client.set_terminated(run.info.run_id, status="KILLED")
        killed.append(run.info.run_id)
    return killed


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), or '' where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return fields[19]  # field 22 of proc(5); fields[0] is field 3 (state)
    except (OSError, IndexError):
        return ""
