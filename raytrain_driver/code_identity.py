"""Which version of the user's code trained a run: a digest of its Python files and, where they are in a git
checkout, the commit. Both are recorded on the MLflow run; a resume that runs other code says so."""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

CODE_DIGEST_TAG = "prefect_raytrain.code_sha256"
CODE_COMMIT_TAG = "prefect_raytrain.code_git_commit"
CODE_CHANGED_TAG = "prefect_raytrain.code_changed"


def code_identity(train_code: str) -> dict[str, str]:
    """The tags that say which code ``train_code`` is: the digest of its top-level package's ``.py`` files (or its
    module's file), and its git commit (``-dirty`` with uncommitted changes) where it is in a checkout."""
    top = importlib.import_module(train_code.partition(":")[0].split(".")[0])
    folders = list(getattr(top, "__path__", []))
    root = Path(folders[0] if folders else str(top.__file__)).resolve()
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts) if root.is_dir() else [root]
    digest = hashlib.sha256()
    try:
        for path in files:  # one JSON line per file: no file name can pass for another's content
            entry = [path.relative_to(root.parent).as_posix(), hashlib.sha256(path.read_bytes()).hexdigest()]
            digest.update(json.dumps(entry).encode() + b"\n")
    except OSError:  # code imported from a zip, or built in: a record only, which must not stop the run
        return {}
    tags = {CODE_DIGEST_TAG: digest.hexdigest()}
    if commit := _git_commit(root if root.is_dir() else root.parent):
        tags[CODE_COMMIT_TAG] = commit
    return tags


def code_change(earlier: dict[str, str], now: dict[str, str], run_key: str) -> str:
    """What a resume of ``run_key`` says when its code is not the code it started with ("" when it is, or when
    the run recorded none): the run goes on, as its settings match."""
    before = earlier.get(CODE_DIGEST_TAG)
    if before is None or before == now[CODE_DIGEST_TAG]:
        return ""
    commits = ""
    if earlier.get(CODE_COMMIT_TAG) or now.get(CODE_COMMIT_TAG):
        commits = f"; git commit {earlier.get(CODE_COMMIT_TAG, '?')} then, {now.get(CODE_COMMIT_TAG, '?')} now"
    return (
        f"run {run_key} resumes with other code than it started with (its files hash {before[:12]} then, "
        f"{now[CODE_DIGEST_TAG][:12]} now{commits}) at {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. Its settings match, "
        "so it goes on; its checkpoints were written by the earlier code"
    )


def _git_commit(folder: Path) -> str:
    """The commit of the checkout ``folder`` is in, ``-dirty`` when its tracked files there changed; "" outside
    a checkout or without git."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=5)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return ""
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip()[:12] + ("-dirty" if status.stdout.strip() else "")
