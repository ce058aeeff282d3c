"""What `prefect-raytrain gc` finds on a node, and how it removes it (raytrain_driver.sweep): a node copy of prepared
data stays while a process that got it lives, and its locks hold across gc's removal. Real processes and the
session's S3 server; no Ray."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from devtools.s3_server import LocalS3
from raytrain_driver.leftovers import Kind, decide
from raytrain_driver.sweep import node_copies, remove
from raytrain_driver.user_data import prepare_user_data
from raytrain_tasks.api import Metric, TrainFunc
from raytrain_tasks.prepared import file_lock, local_data_dir
from raytrain_tasks.storage.locations import locate
from tests.helpers import small_config

USE_AND_WAIT = (
    "import sys, tempfile; tempfile.tempdir = sys.argv[1]\n"
    "from raytrain_tasks import prepared\n"
    "from raytrain_tasks.storage.filesystem import StorageOptions\n"
    "data = prepared.PreparedData.model_validate_json(sys.argv[2])\n"
    "print(prepared.local_data_dir(data, StorageOptions.model_validate_json(sys.argv[3])), flush=True)\n"
    "sys.stdin.read()\n"  # uses the copy until told to end
)


def prepared_on_s3(workdir: Path, server: LocalS3) -> tuple[Any, Any]:
    def prepare(config: dict[str, Any], folder: Path) -> None:
        (folder / "rows.csv").write_text("1,2\n3,4\n")

    config = small_config(
        workdir,
        train_code="someones_project.train:training",
        storage_path=f"s3://prt-tests/sweep-{workdir.name}",
        s3_endpoint_url=server.endpoint_url,
        create_bucket=True,
    )
    code = TrainFunc(lambda config: None, metric=Metric("val_loss", higher_is_better=False), prepare=prepare)
    return config, prepare_user_data(config, code)


def test_a_node_copy_stays_while_a_process_that_got_it_lives(
    s3_server: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    config, version = prepared_on_s3(tmp_path, s3_server)
    storage = locate(config.storage_path, config.storage_options)
    args = [str(node_tmp), version.model_dump_json(), config.storage_options.model_dump_json()]
    worker = subprocess.Popen(
        [sys.executable, "-c", USE_AND_WAIT, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None
        copy = Path(worker.stdout.readline().strip())
        assert (copy / "rows.csv").is_file()
        [found] = node_copies()
        assert (found.kind, found.where, found.in_use) == (Kind.NODE_COPY, str(copy), True)
        assert not decide(found, {}, older_than_s=0).remove
        assert remove(found, storage, older_than_s=0) == "in use now"
        assert (copy / "rows.csv").is_file()
    finally:
        worker.communicate("", timeout=60)
    [found] = node_copies()
    assert found.in_use is False and decide(found, {}, older_than_s=0).remove
    assert remove(found, storage, older_than_s=0) == ""
    assert sorted(p.name for p in copy.parent.iterdir()) == []  # the copy and both its lock files
    assert (local_data_dir(version, config.storage_options) / "rows.csv").is_file()  # made again when needed


def test_a_process_waiting_on_a_lock_file_that_gc_unlinks_takes_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "copy.lock"
    held = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # gc, about to remove the copy
    got: list[bool] = []

    def waiter() -> None:
        with file_lock(path, fcntl.LOCK_EX) as locked:
            # Locked, on the file now at the path: another process taking that path's lock must wait.
            with file_lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB) as also:
                got.append(locked and not also)

    thread = threading.Thread(target=waiter)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # waiting on gc
    path.unlink()
    os.close(held)  # gc lets go of the unlinked file
    thread.join(10)
    assert got == [True]
