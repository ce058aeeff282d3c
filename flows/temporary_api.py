"""The temporary Prefect API that a CLI run starts for itself runs in a process group of its own (see
raytrain_driver/process_groups.py for why, and for Ray's counterpart). tests/flows/test_signals.py fails if
Prefect's shape changes."""

from __future__ import annotations

import functools
import subprocess
from types import SimpleNamespace


def temporary_api_in_its_own_group() -> None:
    """Make the temporary Prefect API server that this process starts (Prefect's ``SubprocessASGIServer``,
    started without ``PREFECT_API_URL``) begin a session of its own.

    Prefect 3.8.8 starts it with ``subprocess.Popen`` in ``SubprocessASGIServer._run_uvicorn_command``
    (prefect/server/api/server.py); the module's ``subprocess`` is replaced by one whose ``Popen`` starts a new
    session, which touches no other caller. Prefect stops the server at this process's exit, as before.
    """
    from prefect.server.api import server

    if getattr(server.subprocess, "own_session", False):
        return
    server.subprocess = SimpleNamespace(  # type: ignore[assignment]
        **{name: getattr(subprocess, name) for name in dir(subprocess) if not name.startswith("__")},
        own_session=True,
    )
    server.subprocess.Popen = functools.partial(  # type: ignore[misc, assignment]
        subprocess.Popen, start_new_session=True, preexec_fn=_end_with_parent
    )


def _end_with_parent() -> None:
    """In the child, before exec: SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG), so a killed run
    (SIGKILL, the OOM killer) takes its temporary API along; a run that exits stops it first (Prefect's atexit).
    The starting thread must live as long as the process (flows.cli keeps it waiting)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
