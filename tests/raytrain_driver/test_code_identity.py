"""Which version of the user's code trained a run: a digest of its files, its git commit, and what a
resume says when the code changed. Real files and a real git checkout; no Ray, no MLflow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_driver.code_identity import CODE_COMMIT_TAG, CODE_DIGEST_TAG, code_change, code_identity

RUN_KEY = "20261206-100000-abcdef"


def _identity(project: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``myproject.train:training`` as a fresh import of what ``project`` holds now."""
    monkeypatch.syspath_prepend(str(project))
    for name in [name for name in sys.modules if name.split(".")[0] == "myproject"]:
        monkeypatch.delitem(sys.modules, name)
    return code_identity("myproject.train:training")


def _git(project: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(project), *args], check=True, capture_output=True)


def test_the_code_that_trained_a_run_is_told_by_its_files_and_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "myproject"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("DEFAULTS = {'hidden': 32}\n")
    first = _identity(tmp_path, monkeypatch)
    assert CODE_COMMIT_TAG not in first  # not in a checkout
    assert _identity(tmp_path, monkeypatch) == first  # the same files, the same digest
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"compiled")
    assert _identity(tmp_path, monkeypatch) == first  # what Python writes beside it is not the code

    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "add", "myproject")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "code")
    committed = _identity(tmp_path, monkeypatch)
    assert committed[CODE_DIGEST_TAG] == first[CODE_DIGEST_TAG]
    assert len(committed[CODE_COMMIT_TAG]) == 12 and not committed[CODE_COMMIT_TAG].endswith("-dirty")

    (package / "train.py").write_text("DEFAULTS = {}\n")  # a default removed, not committed
    changed = _identity(tmp_path, monkeypatch)
    assert changed[CODE_DIGEST_TAG] != first[CODE_DIGEST_TAG]
    assert changed[CODE_COMMIT_TAG] == committed[CODE_COMMIT_TAG] + "-dirty"


@pytest.mark.parametrize(
    ("earlier", "now", "says"),
    [
        ({CODE_DIGEST_TAG: "a" * 64}, {CODE_DIGEST_TAG: "a" * 64}, ""),
        ({}, {CODE_DIGEST_TAG: "a" * 64}, ""),  # started before runs recorded their code: nothing to compare
        ({CODE_DIGEST_TAG: "a" * 64}, {CODE_DIGEST_TAG: "b" * 64}, f"hash {'a' * 12} then, {'b' * 12} now)"),
        (
            {CODE_DIGEST_TAG: "a" * 64, CODE_COMMIT_TAG: "1234567890ab"},
            {CODE_DIGEST_TAG: "b" * 64, CODE_COMMIT_TAG: "1234567890ab-dirty"},
            "git commit 1234567890ab then, 1234567890ab-dirty now",
        ),
    ],
)
def test_a_resume_on_other_code_says_so(earlier: dict[str, str], now: dict[str, str], says: str) -> None:
    said = code_change(earlier, now, RUN_KEY)
    assert (said == "") if not says else (says in said and f"run {RUN_KEY} resumes with other code" in said), said
