"""A pytest plugin: each test's wall seconds and the machine's CPU seconds while it ran, as rows of a TSV.

    pytest -p devtools.pytest_profile --profile-tsv=bench/results/suite_cpu.tsv ...

Write the option with `=`: pytest picks its rootdir and configuration from the paths among its arguments
before it knows this option, and an existing file given as a separate argument would be taken for one.

`make test-profile` runs every tier with it. A test's time counts its setup, call and teardown, so the first
test to use a session fixture (a local Ray, a Prefect API) carries that fixture's start. The CPU seconds are the
whole machine's (every process: Ray's workers, servers, subprocesses), which is what a test costs on 2 cores;
under pytest-xdist two tests run at once and each row includes the other's CPU. Rows are appended, so several
runs (the tiers) write one file; the file gets its header when it is new.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import psutil
import pytest

HEADER = "test\ttier\twall_s\tsystem_cpu_s\n"
_STARTED = "_profile_started"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--profile-tsv", default="", help="append each test's wall and CPU seconds to this TSV file")


def _machine_cpu_s() -> float:
    times = psutil.cpu_times()
    return float(times.user + times.system + getattr(times, "nice", 0.0))


def _tier(item: pytest.Item) -> str:
    if item.get_closest_marker("chaos"):
        return "chaos"
    return "e2e" if item.get_closest_marker("slow") else "fast"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    setattr(item, _STARTED, (time.monotonic(), _machine_cpu_s()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    # Added before the teardown's report is made, so that it travels with it (from an xdist worker too).
    if call.when == "teardown" and hasattr(item, _STARTED):
        wall0, cpu0 = getattr(item, _STARTED)
        item.user_properties.append(("profile", (_tier(item), time.monotonic() - wall0, _machine_cpu_s() - cpu0)))
    yield


class _Rows:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == "profile" and report.when == "teardown":
                tier, wall, cpu = value
                self.rows.append(f"{report.nodeid}\t{tier}\t{wall:.1f}\t{cpu:.1f}\n")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: its reports reach the controller
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        with self.path.open("a") as out:
            if new:
                out.write(HEADER)
            out.writelines(self.rows)


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--profile-tsv")
    if path:
        config.pluginmanager.register(_Rows(Path(path)), "profile-rows")
