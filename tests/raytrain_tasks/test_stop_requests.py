"""What a SIGTERM does to a worker's training code (raytrain_tasks.stop_requests), in a fresh interpreter
each: the handler replaces the process's own, so the test process keeps its. A single process is a group of one,
so no collective is made; the agreement across ranks, drains and Ray Train's restart are tested for real in
tests/raytrain_driver/test_long_runs_fit.py (make test-chaos)."""

from __future__ import annotations

import textwrap

from tests.helpers import run_python

START = """
import os, signal, sys
from raytrain_tasks.api import checkpoint_if_preempted
from raytrain_tasks.stop_requests import StopRequestedError, save_on_sigterm

saved = []
def save():
    saved.append(len(saved))
"""


def _run(body: str) -> tuple[int, str]:
    done = run_python(START + textwrap.dedent(body), timeout=60)
    return done.returncode, done.stdout + done.stderr


def test_a_train_func_that_calls_the_helper_commits_at_its_next_step_then_stops() -> None:
    code, said = _run(
        """
        save_on_sigterm(acted_on=False)  # a train_func's worker
        assert checkpoint_if_preempted(save) is False and saved == []  # nothing asked: nothing saved
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            checkpoint_if_preempted(save)
        except StopRequestedError as stop:
            print("STOPPED", saved, stop)
        """
    )
    assert code == 0, said
    assert "STOPPED [0] stopped after a SIGTERM to a worker, its checkpoint committed" in said, said


def test_a_train_func_that_never_calls_the_helper_ends_at_a_sigterm_as_before() -> None:
    """Ray's own handling: the process ends at once, not after ``SAVE_WITHIN_S`` spent waiting for code that never
    asks."""
    code, said = _run(
        """
        save_on_sigterm(acted_on=False)
        os.kill(os.getpid(), signal.SIGTERM)
        print("STILL RUNNING")
        """
    )
    assert code == 128 + 15 and "STILL RUNNING" not in said, said


def test_a_second_sigterm_ends_the_process_at_once() -> None:
    """The first asks for a checkpoint; a second (someone who means it) is not held back."""
    code, said = _run(
        """
        save_on_sigterm(acted_on=True)  # a TrainSpec's loop
        os.kill(os.getpid(), signal.SIGTERM)
        print("ASKED")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGTERM)
        print("STILL RUNNING")
        """
    )
    assert code == 128 + 15 and "ASKED" in said and "STILL RUNNING" not in said, said
