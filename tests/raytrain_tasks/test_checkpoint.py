"""Where a checkpoint is written before Ray Train uploads it, and the folder each epoch's is committed under."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raytrain_tasks.trainspec.resume import checkpoint_dir_name


def test_an_epoch_trained_again_never_reuses_the_folder_of_the_checkpoint_it_replaces() -> None:
    """After a fallback to an older checkpoint, the next epochs go to folders of their own: Ray Train evicting the
    old entry later would delete the folder, and the new checkpoint in it."""
    assert checkpoint_dir_name(0) == "epoch-0001" and checkpoint_dir_name(11) == "epoch-0012"
    assert checkpoint_dir_name(1, frozenset({"epoch-0002"})) == "epoch-0002-r1"
    assert checkpoint_dir_name(1, frozenset({"epoch-0002", "epoch-0002-r1"})) == "epoch-0002-r2"


KEY = "20261124-110000-abc123"


def test_a_staging_folder_left_by_a_killed_attempt_is_replaced_by_the_runs_next_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raytrain_tasks.trainspec.checkpoint import STAGING_PREFIX, staging_folder

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    left = tmp_path / f"{STAGING_PREFIX}{os.getuid()}" / KEY
    left.parent.mkdir(mode=0o700)  # as the first checkpoint on this node made it
    left.mkdir()
    (left / "model.pt").write_bytes(b"half-written by a worker that was killed")
    with staging_folder(KEY) as folder:
        assert folder == left and list(folder.iterdir()) == []  # nothing stale goes into the new checkpoint
        (folder / "model.pt").write_bytes(b"x")
    assert not left.exists()
    assert not list(tmp_path.glob("prt-ckpt-*"))


@pytest.mark.parametrize("unsafe", ["a link", "open to others"])
def test_a_staging_parent_that_is_not_this_users_own_is_never_used_or_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unsafe: str
) -> None:
    from raytrain_tasks.trainspec.checkpoint import STAGING_PREFIX, staging_folder

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    elsewhere = tmp_path / "someone-elses"
    (elsewhere / KEY).mkdir(parents=True)
    (elsewhere / KEY / "keep.txt").write_text("not ours")
    root = tmp_path / f"{STAGING_PREFIX}{os.getuid()}"
    if unsafe == "a link":
        root.symlink_to(elsewhere, target_is_directory=True)
    else:
        elsewhere.rename(root)
        root.chmod(0o777)
    with staging_folder(KEY) as folder:
        assert folder.name.startswith("prt-ckpt-") and folder.parent == tmp_path  # a fresh temporary folder
    assert (root / KEY / "keep.txt").read_text() == "not ours"
    assert not folder.exists()


def test_without_a_run_key_each_checkpoint_gets_a_fresh_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raytrain_tasks.trainspec.checkpoint import staging_folder

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with staging_folder(None) as first, staging_folder(None) as second:
        assert first != second and first.parent == second.parent == tmp_path
    assert list(tmp_path.iterdir()) == []
