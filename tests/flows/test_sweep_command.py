"""`prefect-raytrain sweep` refuses a search it cannot run before it starts Prefect or Ray: one message naming the
key, exit status 2."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

import flows.sweep_command as sweep_command


@pytest.mark.parametrize(
    ("search", "says"),
    [
        ('{"learning_rate": [0.1, }', "search is not valid JSON"),
        ('{"learning_rat": [0.1]}', "did you mean 'learning_rate'?"),
        ('{"learning_rate": {"loguniform": [0.1, 0.01]}}', "low below high"),
        ('{"epochs": [2, 3]}', "is the same for every trial of a sweep"),
    ],
)
def test_a_search_that_cannot_run_is_refused_once_before_prefect_or_ray_start(
    search: str, says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Any] = []

    @contextlib.contextmanager
    def local_services(config: Any) -> Iterator[None]:
        started.append(config)
        yield

    monkeypatch.setattr(sweep_command, "local_services", local_services)
    assert sweep_command.main(["--search", search, "--trials", "2", "--epochs", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count(says) == 1 and err.strip().startswith("sweep failed: search"), err
    assert not started  # no temporary Prefect API, no Ray
