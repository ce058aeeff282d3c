"""`prefect-raytrain champions NAME` and `prefect-raytrain rollback NAME --to VERSION --reason TEXT`, called as the
console script calls them (flows.command.main with argv), on a real SQLite registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.champions_command import who
from flows.command import main
from tests.registered_versions import registered_versions


def _lines(capsys: pytest.CaptureFixture[str]) -> tuple[list[str], str]:
    """(stdout's lines, the command's own stderr lines): not the "Logging error" of a library's log handler that
    holds an earlier test's captured stream."""
    said = capsys.readouterr()
    return said.out.splitlines(), "\n".join(
        line for line in said.err.splitlines() if line.startswith("prefect-raytrain")
    )


def test_champions_lists_the_history_newest_first_and_rollback_adds_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, client, (v1, v2, v3) = registered_versions(tmp_path, "listed", 3)
    where = ["--mlflow-tracking-uri", uri]
    assert main(["champions", "listed", *where]) == 0
    (line,) = _lines(capsys)[0]
    assert line == f"listed at {uri} has no champion history: no version was ever its champion"

    client.set_registered_model_alias("listed", "champion", v3)  # by hand, in the MLflow UI
    assert main(["rollback", "listed", "--to", v1, "--reason", "v3 mislabels returns", *where]) == 0
    out, _ = _lines(capsys)
    assert out[0] == f"listed@champion: version {v3} -> version {v1} (previous_champion: {v3})"
    assert out[1] == f"recorded as move 1 (rollback by {who()}): `prefect-raytrain champions listed` lists it"

    assert main(["champions", "listed", *where]) == 0
    out, _ = _lines(capsys)
    assert out[0] == f"champion history of listed at {uri} (champion now: version {v1}):"
    assert out[1].split() == ["TIME", "VERSION", "PREVIOUS", "BY", "RUN", "REASON"]
    newest, before = out[2], out[3]
    assert newest.split()[3:6] == [v1, v3, "rollback"] and newest.endswith("v3 mislabels returns")  # after the time
    assert f"rollback by {who()}" in newest and "20261201-000001-aaaaaa" in newest
    assert before.split()[:3] == ["?", v3, "-"] and "outside prefect-raytrain (not recorded)" in before
    assert len(out) == 4


def test_a_refused_rollback_says_why_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri, client, (v1, _) = registered_versions(tmp_path, "kept", 2)
    client.set_registered_model_alias("kept", "champion", v1)
    assert main(["rollback", "kept", "--to", v1, "--reason", "again", "--mlflow-tracking-uri", uri]) == 2
    out, err = _lines(capsys)
    assert not out and err.startswith("prefect-raytrain rollback: kept: refused to roll back champion to version 1")
    assert "is the champion already" in err and "--to" in err and "Nothing moved" in err
    with pytest.raises(SystemExit) as usage:  # a rollback without a reason is not even tried
        main(["rollback", "kept", "--to", "2", "--mlflow-tracking-uri", uri])
    assert usage.value.code == 2 and "the following arguments are required: --reason" in capsys.readouterr().err


def test_champions_of_a_model_or_store_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}"
    assert main(["champions", "any", "--mlflow-tracking-uri", missing]) == 2
    assert f"no MLflow store at {missing}" in _lines(capsys)[1]
    assert not (tmp_path / "none").exists()  # looking made no store
    uri, _, _ = registered_versions(tmp_path, "there", 1)
    assert main(["champions", "thare", "--mlflow-tracking-uri", uri]) == 2
    assert "cannot read registered model 'thare'" in _lines(capsys)[1]
