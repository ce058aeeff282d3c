"""Find what `prefect-raytrain gc` may remove, and remove it (the rules: raytrain_driver.leftovers).

On this node: the copies of prepared data (raytrain_tasks.prepared) and the checkpoint staging folders
(raytrain_tasks.trainspec.checkpoint) in the temporary directory, and the pin journals under the orchestrator's state
folder (raytrain_tasks.tracking.pin_journal). In storage: the checkpoint folders of each run that were never committed,
and the files a killed write left (``<name>.<8 hex>.tmp``, ``.write-probe-*``). Dataset versions are never removed.

Each removal checks again first what can change meanwhile: a node copy's locks, the run's lease, the age.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from raytrain_driver.lease import LEASE_FILE, read_lease
from raytrain_driver.leftovers import Kind, Leftover, RunState
from raytrain_driver.user_data import STAGED
from raytrain_tasks.config import RUN_KEY_PATTERN
from raytrain_tasks.errors import StorageError
from raytrain_tasks.prepared import FILES_DIR, MARKER_NAME, copy_lock, file_lock, node_copies_dir, use_lock
from raytrain_tasks.storage.filesystem import is_s3
from raytrain_tasks.storage.locations import DATASETS_DIR, RUNS_DIR, StorageLocation
from raytrain_tasks.tracking.pin_journal import PinJournal

NOW_AND_THEN = fcntl.LOCK_EX | fcntl.LOCK_NB
PROBE_PREFIX = ".write-probe-"


@dataclass(frozen=True)
class Pins:
    """Where the runs' pins are: an MLflow client (None, with ``why``, when the store cannot be read), the
    experiment of the runs (None: not there), and this machine's pin journals."""

    client: Any
    experiment_id: str | None
    journals: Path
    why: str = ""


def find_leftovers(storage: StorageLocation, pins: Pins) -> tuple[list[Leftover], dict[str, RunState]]:
    """Every leftover on this node and in ``storage``, with what is known of it; and the state of each run there."""
    runs_dir = storage.child(RUNS_DIR)
    runs = {key: run_state(runs_dir.child(key)) for key in runs_dir.list_names() if RUN_KEY_PATTERN.fullmatch(key)}
    items = node_copies() + staging_folders() + journals(pins)
    for key in runs:
        items += uncommitted_checkpoints(runs_dir.child(key), key, pins)
    return items + interrupted_writes(storage), runs


def run_state(run_dir: StorageLocation) -> RunState:
    try:
        lease = read_lease(run_dir.child(LEASE_FILE))
    except (OSError, StorageError) as exc:
        return RunState(None, f"{type(exc).__name__}: {exc}"[:200])
    return RunState(lease is not None and lease.remaining_s > 0)


def node_copies() -> list[Leftover]:
    """This node's copies of prepared data: one item per version (its folder and lock files, or the lock files
    alone), one per unfinished copy (``.partial-*``, ``.stale-*``)."""
    root = node_copies_dir()
    if not _plain_dir(root):
        return []
    items, versions = [], set()
    for entry in sorted(root.iterdir()):
        name, dot, rest = entry.name.partition(".")
        if not _is_hash(name):
            continue  # not this project's
        if rest.startswith(("partial-", "stale-")) and _plain_dir(entry):
            free = _lock_free(copy_lock(root / name))
            items.append(Leftover(Kind.PARTIAL_COPY, str(entry), _bytes(entry), _age(entry), in_use=not free))
            versions.add(name)  # its lock files go with the version's, after it
        elif (not dot and _plain_dir(entry)) or rest in ("lock", "use"):
            versions.add(name)
    for name in sorted(versions):
        folder = root / name
        in_use = not (_lock_free(copy_lock(folder)) and _lock_free(use_lock(folder)))
        items.append(Leftover(Kind.NODE_COPY, str(folder), _bytes(folder), _copy_age(folder), in_use=in_use))
    return items


def _copy_age(folder: Path) -> float:
    """Since the copy was last made or used: its use lock is dated at each use."""
    times = [p.lstat().st_mtime for p in (folder, copy_lock(folder), use_lock(folder)) if p.exists()]
    return time.time() - max(times, default=0.0)


def staging_folders() -> list[Leftover]:
    """This user's checkpoint staging folders on this node, one per run key."""
    from raytrain_tasks.trainspec.checkpoint import STAGING_PREFIX

    root = Path(tempfile.gettempdir()) / f"{STAGING_PREFIX}{os.getuid()}"
    if not _plain_dir(root) or root.lstat().st_uid != os.getuid():
        return []  # not this user's own: raytrain_tasks.trainspec.checkpoint does not use it either
    return [
        Leftover(Kind.CHECKPOINT_STAGING, str(entry), _bytes(entry), _age(entry), run_key=entry.name)
        for entry in sorted(root.iterdir())
        if RUN_KEY_PATTERN.fullmatch(entry.name) and _plain_dir(entry)
    ]


def journals(pins: Pins) -> list[Leftover]:
    """This machine's pin journals; each goes only once MLflow holds every pin in it."""
    if not _plain_dir(pins.journals):
        return []
    items = []
    for path in sorted(pins.journals.glob("*.jsonl")):
        if not RUN_KEY_PATTERN.fullmatch(path.stem):
            continue
        info = path.lstat()
        unsynced, note = _unsynced(path, info, pins)
        item = Leftover(Kind.PIN_JOURNAL, str(path), info.st_size, _age(path), path.stem, unsynced=unsynced, note=note)
        items.append(item)
    return items


def _unsynced(path: Path, info: os.stat_result, pins: Pins) -> tuple[bool | None, str]:
    """Whether the journal holds a pin MLflow lacks (None when that cannot be told, and why)."""
    from mlflow.exceptions import MlflowException

    from raytrain_tasks.tracking.names import pinned_digests

    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None, "not a private file of this user"
    if pins.client is None:
        return None, pins.why
    journal = PinJournal(str(path), socket.gethostname())
    try:
        for run_id in sorted(journal.run_ids()):
            known = pinned_digests(pins.client.get_run(run_id).data.tags)
            if any(entry.checkpoint not in known for entry in journal.entries(run_id)):
                return True, ""
    except (OSError, MlflowException) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:200]
    return False, ""


def uncommitted_checkpoints(run_dir: StorageLocation, run_key: str, pins: Pins) -> list[Leftover]:
    """The run's checkpoint folders that neither Ray Train's record nor fit.json lists, with whether one is pinned."""
    from raytrain_driver.fit_steps import is_checkpoint_folder

    folders = [name for name in run_dir.list_names() if is_checkpoint_folder(name)]
    if not folders:
        return []
    listed, note = _listed(run_dir)
    candidates = [name for name in folders if listed is None or name not in listed]
    pinned, pins_note = _pinned(run_key, pins) if listed is not None and candidates else (None, "")
    items = []
    for name in candidates:
        folder = run_dir.child(name)
        size, age = _stored_size_and_age(folder)
        items.append(
            Leftover(
                Kind.UNCOMMITTED_CHECKPOINT,
                folder.uri,
                size,
                age,
                run_key,
                listed=None if listed is None else False,
                pinned=None if pinned is None else name in pinned,
                note=note or pins_note,
            )
        )
    return items


def _listed(run_dir: StorageLocation) -> tuple[frozenset[str] | None, str]:
    from raytrain_driver.fit_record import FIT_RECORD, FitResult
    from raytrain_driver.ray_record import recorded_folders
    from raytrain_tasks.tracking.names import checkpoint_name

    try:
        names = set(recorded_folders(run_dir))
        record = run_dir.child(FIT_RECORD)
        if record.exists():
            names.add(checkpoint_name(FitResult.model_validate_json(record.read_text()).best_checkpoint_uri))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:200]
    return frozenset(names), ""


def _pinned(run_key: str, pins: Pins) -> tuple[frozenset[str] | None, str]:
    """The folders pinned for the run: in its MLflow run, or this machine's journal of it."""
    from mlflow.exceptions import MlflowException

    from raytrain_tasks.tracking import runs as tracking
    from raytrain_tasks.tracking.names import pinned_digests

    if pins.client is None:
        return None, pins.why
    if pins.experiment_id is None:
        return None, "the experiment is not in the MLflow store"
    try:
        run = tracking.find_run(pins.client, pins.experiment_id, run_key)
    except MlflowException as exc:
        return None, f"MLflow: {exc}"[:200]
    if run is None:
        return None, f"no MLflow run of run key {run_key} in the experiment"
    names = set(pinned_digests(run.data.tags))
    journal = PinJournal.for_run(pins.journals, run_key)
    names |= {entry.checkpoint for entry in journal.entries(run.info.run_id)}
    return frozenset(names), ""


def interrupted_writes(storage: StorageLocation) -> list[Leftover]:
    """Storage check probes at the storage's top; on local storage also the ``<name>.<8 hex>.tmp`` files a killed
    write left in the runs' folders and the dataset versions (S3 replaces an object whole: it leaves none)."""
    probes = [storage.child(name) for name in storage.list_names() if name.startswith(PROBE_PREFIX)]
    items = [Leftover(Kind.INTERRUPTED_WRITE, p.uri, *_stored_size_and_age(p)) for p in probes]
    if is_s3(storage.uri):
        return items
    runs = Path(storage.path, RUNS_DIR)
    for run in sorted(runs.iterdir()) if _plain_dir(runs) else []:
        if not _plain_dir(run):  # a stray file beside the runs' folders is not a run
            continue
        files = [path for path in sorted(run.iterdir()) if STAGED.fullmatch(path.name) and path.is_file()]
        items += [
            Leftover(Kind.INTERRUPTED_WRITE, str(path), path.stat().st_size, _age(path), run_key=run.name)
            for path in files
        ]
    datasets = Path(storage.path, DATASETS_DIR)
    for version in sorted(datasets.iterdir()) if _plain_dir(datasets) else []:
        for path in sorted(version.rglob("*")):
            if STAGED.fullmatch(path.name) and path.is_file() and not path.is_symlink():
                listed, note = _in_version(version, path)
                size, age = path.stat().st_size, _age(path)
                items.append(Leftover(Kind.INTERRUPTED_WRITE, str(path), size, age, listed=listed, note=note))
    return items


def _in_version(version: Path, path: Path) -> tuple[bool | None, str]:
    """Whether a staged-looking file under a prepared version's files may be one of them: a prepare may write a
    file of that name. It is not when the version's marker counts exactly the other files there."""
    files = version / FILES_DIR
    if not path.is_relative_to(files):
        return False, ""  # beside the files: the marker's or a table's, never a prepare's
    try:
        marker = json.loads((version / MARKER_NAME).read_text())
        others = [p for p in files.rglob("*") if p.is_file() and not STAGED.fullmatch(p.name)]
        return (None, "the version's marker counts it") if len(others) != marker["files"] else (False, "")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"the version's marker cannot be read: {type(exc).__name__}"


def remove(item: Leftover, storage: StorageLocation, older_than_s: float) -> str:
    """Remove ``item`` after checking again what may have changed since it was found; "" when removed, else why
    it stays. OSError when it cannot be removed."""
    if item.kind in (Kind.CHECKPOINT_STAGING, Kind.UNCOMMITTED_CHECKPOINT, Kind.PIN_JOURNAL):
        if run_state(storage.child(RUNS_DIR, item.run_key)).live is not False:
            return "its run's lease is held now"
    if item.kind is Kind.NODE_COPY:
        folder = Path(item.where)
        with file_lock(copy_lock(folder), NOW_AND_THEN) as free, file_lock(use_lock(folder), NOW_AND_THEN) as unused:
            if not (free and unused):
                return "in use now"
            if _copy_age(folder) < older_than_s:
                return "used since it was found"
            if folder.exists():
                shutil.rmtree(folder)
            use_lock(folder).unlink(missing_ok=True)  # a process waiting on it finds the file gone, and retries
            copy_lock(folder).unlink(missing_ok=True)
        return ""
    if item.kind is Kind.PARTIAL_COPY:
        name = Path(item.where).name.partition(".")[0]
        with file_lock(copy_lock(Path(item.where).with_name(name)), NOW_AND_THEN) as free:
            if not free:
                return "a copy is being made now"
            shutil.rmtree(item.where)
        return ""
    if item.kind is Kind.UNCOMMITTED_CHECKPOINT:
        storage.filesystem.delete_dir(_path_of(item.where, storage))
        return ""
    if is_s3(item.where):  # a storage check probe
        storage.filesystem.delete_file(_path_of(item.where, storage))
        return ""
    if _age(Path(item.where)) < older_than_s:
        return "changed since it was found"
    if Path(item.where).is_dir():
        shutil.rmtree(item.where)
    else:
        Path(item.where).unlink()
    return ""


def _path_of(uri: str, storage: StorageLocation) -> str:
    """The filesystem path of ``uri``, an item found under ``storage``."""
    return storage.path.rstrip("/") + uri[len(storage.uri.rstrip("/")) :]


def _stored_size_and_age(location: StorageLocation) -> tuple[int, float]:
    """Bytes under ``location`` (a file or a folder) and seconds since the newest of them was written."""
    filesystem = location.filesystem
    top = filesystem.get_file_info(location.path)
    infos = [top]
    if top.type == pafs.FileType.Directory:
        infos += filesystem.get_file_info(pafs.FileSelector(location.path, recursive=True))
    files = [info for info in infos if info.type == pafs.FileType.File]
    times = [info.mtime.timestamp() for info in infos if info.mtime is not None]
    # Nothing dated (an S3 folder with no object under it) counts as new: it stays.
    return sum(info.size or 0 for info in files), time.time() - max(times, default=time.time())


def _age(path: Path) -> float:
    """Seconds since anything at or under ``path`` was last written (links not followed)."""
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
                except FileNotFoundError:
                    continue
    return time.time() - newest


def _bytes(path: Path) -> int:
    if not path.exists():
        return 0
    if not path.is_dir():
        return path.lstat().st_size
    return sum(os.lstat(os.path.join(root, name)).st_size for root, _, files in os.walk(path) for name in files)


def _plain_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _is_hash(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _lock_free(path: Path) -> bool:
    """Whether no process holds the lock file ``path`` (a missing one is free); the look creates nothing."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(descriptor, NOW_AND_THEN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(descriptor)
