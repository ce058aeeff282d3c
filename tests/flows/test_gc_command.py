"""`prefect-raytrain gc` on real folders: a dry run removes nothing; --apply removes exactly the leftovers and keeps a
live run's folder, every checkpoint Ray Train's record lists or MLflow pinned, and the dataset versions. Local
storage with a node's temporary folder and pin journals, and the session's S3 server; a real MLflow store."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from devtools.s3_server import LocalS3
from flows.command import gc
from raytrain_driver.lease import LEASE_FILE
from raytrain_tasks.storage.locations import RUNS_DIR, StorageLocation, check_writable, locate
from raytrain_tasks.tracking.names import pin_tag
from raytrain_tasks.tracking.pin_journal import JournalEntry, PinJournal
from raytrain_tasks.tracking.pins import pin_journal_dir
from raytrain_tasks.tracking.runs import RUN_KEY_TAG
from tests.helpers import mlflow_client, small_config

DONE, LIVE, ELSEWHERE = "20261127-080000-aaaaaa", "20261127-080000-bbbbbb", "20261127-080000-cccccc"
LISTED, PINNED = "checkpoint_2026-11-27_08-00-00.000001", "checkpoint_2026-11-27_08-00-05.000001"
NEVER, FRESH = "checkpoint_2026-11-27_08-00-09.000001", "checkpoint_2026-11-27_08-00-12.000001"
DIGEST = "ab" * 32
TWO_DAYS_AGO = time.time() - 48 * 3600
VERSION, IN_USE = "1" * 64, "2" * 64


def a_run(run_dir: StorageLocation, listed: list[str], unlisted: list[str], live: bool = False) -> None:
    """A run's folder as Ray Train and the driver leave it: checkpoints, Ray Train's record, a lease if live."""
    for name in [*listed, *unlisted]:
        run_dir.child(name, "model.pt").write_bytes(b"w" * 100)
    record = {"checkpoint_results": [{"checkpoint_dir_name": name} for name in listed]}
    run_dir.child("checkpoint_manager_snapshot.json").write_text(json.dumps(record))
    if live:  # another driver's, renewed a moment ago
        lease = {"holder": "other-host:4242", "duration_s": 3600, "renewals": 3}
        assert run_dir.child(LEASE_FILE).write_if(json.dumps(lease), None) is not None


def an_mlflow_run(workdir: Path, run_key: str, pinned: list[str]) -> str:
    client = mlflow_client(workdir)
    experiment = client.get_experiment_by_name("tests") or client.get_experiment(client.create_experiment("tests"))
    tags = {RUN_KEY_TAG: run_key} | {pin_tag(name): DIGEST for name in pinned}
    return str(client.create_run(experiment.experiment_id, tags=tags).info.run_id)


def age(*paths: Path) -> None:
    for path in paths:
        for found in [path, *path.rglob("*")]:
            os.utime(found, (TWO_DAYS_AGO, TWO_DAYS_AGO))


def everything(*roots: Path) -> set[str]:
    return {str(path) for root in roots for path in root.rglob("*")}


def run_gc(config: Any, *flags: str) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gc(
            [
                f"--storage-path={config.storage_path}",
                f"--mlflow-tracking-uri={config.mlflow_tracking_uri}",
                "--experiment-name=tests",
                f"--s3-endpoint-url={config.s3_endpoint_url}",
                *flags,
            ]
        )
    return code, out.getvalue()


def test_local_storage_and_this_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node_tmp, home = tmp_path / "node-tmp", tmp_path / "prefect-home"
    node_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    monkeypatch.setenv("PREFECT_HOME", str(home))
    config = small_config(tmp_path)
    storage = Path(config.storage_path)
    runs = locate(config.storage_path).child(RUNS_DIR)
    done_id = an_mlflow_run(tmp_path, DONE, pinned=[PINNED])
    an_mlflow_run(tmp_path, LIVE, pinned=[])

    # Runs: one finished long ago, one live (its lease held by another driver), each with a folder never committed.
    a_run(runs.child(DONE), listed=[LISTED], unlisted=[PINNED, NEVER, FRESH])
    a_run(runs.child(LIVE), listed=[LISTED], unlisted=[NEVER], live=True)
    killed_write = storage / RUNS_DIR / DONE / "fit.json.0badc0de.tmp"
    killed_write.write_text("{")
    # A dataset version, with the file a killed write of it left.
    version = storage / "datasets" / VERSION
    (version / "files").mkdir(parents=True)
    (version / "files" / "rows.csv").write_text("1,2\n")
    (version / "prepared.json").write_text(json.dumps({"files": 1}))
    (version / "files" / "rows.csv.0123abcd.tmp").write_text("1,")
    # This node: staging folders of both runs; a node copy unused, one in use (its use lock held), an unfinished one.
    staging = node_tmp / f"prefect-raytrain-staging-{os.getuid()}"
    for key in (DONE, LIVE):
        (staging / key).mkdir(parents=True)
        (staging / key / "model.pt").write_bytes(b"s" * 50)
    copies = node_tmp / "prefect-raytrain-data"
    for name in (VERSION, IN_USE, f"{VERSION}.partial-77-0badc0de"):
        (copies / name).mkdir(parents=True)
        (copies / name / "rows.csv").write_text("1,2\n")
    for name in (f"{VERSION}.lock", f"{VERSION}.use", f"{IN_USE}.lock", f"{IN_USE}.use"):
        (copies / name).touch()
    # Pin journals: the finished run's (MLflow holds its pin), the live run's, and one of a run of other storage.
    journals = pin_journal_dir(home)
    entry = JournalEntry(PINNED, DIGEST, 1, {"val_loss": 0.5})
    for key in (DONE, LIVE, ELSEWHERE):
        assert PinJournal.for_run(journals, key).append(done_id, entry)
    fresh = runs.child(DONE, FRESH).path
    age(storage, node_tmp, home)
    os.utime(Path(runs.child(LIVE).path) / LEASE_FILE)  # renewed just now
    for path in (Path(fresh), Path(fresh) / "model.pt"):
        os.utime(path)  # written a moment ago

    before = everything(storage, node_tmp, home)
    user = open(copies / f"{IN_USE}.use")  # noqa: SIM115 - a process of this node using that copy
    fcntl.flock(user, fcntl.LOCK_SH)
    try:
        code, dry = run_gc(config)
        assert code == 0, dry
        assert everything(storage, node_tmp, home) == before, dry
        assert "dry run, nothing removed" in dry and "checkpoint folders never committed: would remove 1 (" in dry

        code, applied = run_gc(config, "--apply")
        assert code == 0, applied
    finally:
        user.close()
    gone = before - everything(storage, node_tmp, home)
    done_dir = storage / RUNS_DIR / DONE
    assert gone == {
        str(done_dir / NEVER),
        str(done_dir / NEVER / "model.pt"),
        str(killed_write),
        str(version / "files" / "rows.csv.0123abcd.tmp"),
        str(staging / DONE),
        str(staging / DONE / "model.pt"),
        *(str(copies / VERSION / name) for name in ("", "rows.csv")),
        *(str(copies / f"{VERSION}{suffix}") for suffix in (".lock", ".use")),
        *(str(copies / f"{VERSION}.partial-77-0badc0de" / name) for name in ("", "rows.csv")),
        str(journals / f"{DONE}.jsonl"),
    }, applied
    assert "kept 1: its run's lease is held" in applied
    assert "kept 1: pinned: committed, though Ray Train's record no longer lists it" in applied
    assert "kept 1: in use by a process of this node" in applied

    # Its user gone, the copy in use goes next time; nothing else is left to remove.
    again = run_gc(config)[1]
    assert f"would remove 1 (4 B)\n  {copies / IN_USE}  4 B\n" in again and "would remove 4 B in all" in again, again


def test_s3_storage(s3_server: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = small_config(
        tmp_path, storage_path=f"s3://prt-tests/gc-{tmp_path.name}", s3_endpoint_url=s3_server.endpoint_url
    )
    root = locate(config.storage_path, config.storage_options)
    check_writable(root, create_bucket=True)
    runs = root.child(RUNS_DIR)
    an_mlflow_run(tmp_path, DONE, pinned=[PINNED])
    a_run(runs.child(DONE), listed=[LISTED], unlisted=[PINNED, NEVER])
    a_run(runs.child(LIVE), listed=[], unlisted=[NEVER], live=True)
    root.child(".write-probe-0badc0de").write_text("ok")  # a storage check killed before it deleted its probe

    def keys() -> set[str]:
        infos = root.filesystem.get_file_info(pafs.FileSelector(root.path, recursive=True))
        return {info.path for info in infos if info.type == pafs.FileType.File}

    before = keys()
    time.sleep(1.1)  # S3 dates objects to the second
    assert run_gc(config, "--older-than=0")[0] == 0
    assert keys() == before
    code, applied = run_gc(config, "--older-than=0", "--apply")
    assert code == 0, applied
    assert before - keys() == {runs.child(DONE, NEVER, "model.pt").path, root.child(".write-probe-0badc0de").path}
