"""The data your code's ``prepare(config, folder)`` wrote (raytrain_tasks.api), as a stored version and as the
local folder every process of the run reads it from (``config["data_dir"]``).

A version lives in ``<storage_path>/datasets/<content hash>/``: the files under ``files/``, then ``prepared.json``
written last (a folder without it is incomplete and is written again). The content hash is
``raytrain_tasks.integrity``'s digest of the files: their relative paths, sizes and SHA-256s.

On local storage the stored folder is read in place; on S3 each node copies it once into its temporary directory
(``prefect-raytrain-data/<hash>``), shared by the node's processes. Either way the files are hashed before your code
sees them, and a folder whose files no longer hash to the version's content is refused.

Beside a node copy, ``<hash>.lock`` is held while the copy is made or checked, and ``<hash>.use`` is held shared by
every process that got the copy, until it exits (its mtime is the copy's last use): `prefect-raytrain gc` removes a
copy only when it can take both (raytrain_driver.sweep).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from raytrain_tasks.errors import DatasetError
from raytrain_tasks.storage.filesystem import StorageOptions, is_s3, open_filesystem

logger = logging.getLogger(__name__)

FILES_DIR = "files"
MARKER_NAME = "prepared.json"
CACHE_DIR = "prefect-raytrain-data"


class PreparedData(BaseModel):
    """A stored version of what ``prepare`` wrote."""

    model_config = ConfigDict(frozen=True)

    uri: str  # the version's folder: <storage_path>/datasets/<content_hash>
    content_hash: str
    source: str  # the train_code whose prepare wrote it
    files: int
    bytes: int
    summary: str = ""  # the line prepare returned on what it wrote (rows, columns, classes...), if any

    def describe(self) -> str:
        """One line on what the version holds (logs, run pages)."""
        size = f"{self.summary} in {self.files} files" if self.summary else f"{self.files} files, {self.bytes} bytes"
        return f"prepared data {self.content_hash}: {size} from {self.source}'s prepare at {self.uri}"

    @property
    def files_uri(self) -> str:
        return f"{self.uri.rstrip('/')}/{FILES_DIR}"


def local_data_dir(data: PreparedData, options: StorageOptions) -> Path:
    """A local folder holding exactly the version's files: the stored one itself on local storage, this node's
    copy of it on S3 (made once per node, under a lock its processes share; a copy changed since is made again).
    DatasetError when the stored files do not hash to the version's content."""
    from raytrain_tasks.integrity import local_folder_digest

    if not is_s3(data.uri):
        _, path = open_filesystem(data.files_uri, options)
        folder = Path(path)
        _check(folder, local_folder_digest(folder, ignore=_being_replaced), data, "its stored folder")
        return folder
    folder = node_copies_dir() / data.content_hash
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(copy_lock(folder), fcntl.LOCK_EX):  # the node's other workers wait for the one copy, then use it
        if folder.is_dir():
            if local_folder_digest(folder) == data.content_hash:
                _hold_in_use(folder)
                return folder
            logger.warning(
                "this node's copy of the prepared data %s changed since it was made: copying it again", folder
            )
            stale = folder.with_name(f"{folder.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            folder.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            _download(data, options, partial)
            _check(partial, local_folder_digest(partial), data, "the copy downloaded from storage")
            partial.rename(folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        _hold_in_use(folder)  # before the copy's lock is let go: gc, which takes both, finds it in use
    return folder


def node_copies_dir() -> Path:
    """This node's folder of copies of prepared data read from S3."""
    return Path(tempfile.gettempdir()) / CACHE_DIR


def copy_lock(folder: Path) -> Path:
    """The file locked while the node copy ``folder`` is made or checked."""
    return folder.with_name(f"{folder.name}.lock")


def use_lock(folder: Path) -> Path:
    """The file every process that uses the node copy ``folder`` holds shared, until it exits."""
    return folder.with_name(f"{folder.name}.use")


@contextmanager
def file_lock(path: Path, mode: int) -> Iterator[bool]:
    """Hold ``flock(mode)`` on the file at ``path`` (made if missing) for the block. False, holding nothing, when
    ``mode`` has ``LOCK_NB`` and another process holds it. The lock is on the file found at ``path`` once it is
    taken: gc unlinks a lock file it holds, and a lock on that unlinked file would guard nothing."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(descriptor, mode)
            except BlockingIOError:
                yield False
                return
            if _still_at(descriptor, path):
                yield True
                return
        finally:
            os.close(descriptor)  # releases the lock


# The shared locks this process holds on the node copies it uses, by path, open until it exits.
_IN_USE: dict[Path, int] = {}


def _hold_in_use(folder: Path) -> None:
    """Hold the copy's use lock shared until this process exits, and date its last use. Called under the copy's
    lock, which gc takes first: this never waits on gc."""
    path = use_lock(folder)
    if path not in _IN_USE:
        while True:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(descriptor, fcntl.LOCK_SH)
            if _still_at(descriptor, path):
                _IN_USE[path] = descriptor
                break
            os.close(descriptor)
    os.utime(_IN_USE[path])


def _still_at(descriptor: int, path: Path) -> bool:
    """Whether the open file ``descriptor`` is still the one at ``path``."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (found.st_dev, found.st_ino) == (opened.st_dev, opened.st_ino)


# How recently another writer's copy must have been written to be taken for one still being written: a stale one
# (its writer killed, or planted by whoever can write storage) is refused with the folder, as any foreign file.
BEING_WRITTEN_S = 300.0


def _being_replaced(file: Path) -> bool:
    """Whether ``file`` is another writer's new copy of a file beside it, still being written (a second run
    preparing the same content at the same moment: raytrain_tasks.storage.folder_cas writes each file so under a
    temporary name, then renames it); not the version's."""
    name, dot, suffix = file.name.rpartition(".")
    original, _, token = name.rpartition(".")
    if not (dot and suffix == "tmp" and len(token) == 8 and _is_hex(token) and file.with_name(original).is_file()):
        return False
    return time.time() - file.stat().st_mtime < BEING_WRITTEN_S


def _is_hex(text: str) -> bool:
    return all(char in "0123456789abcdef" for char in text)


def _download(data: PreparedData, options: StorageOptions, destination: Path) -> None:
    from raytrain_tasks.storage.locations import download_dir, locate

    download_dir(locate(data.files_uri, options), destination)  # StorageError naming the URI when it cannot


def _check(folder: Path, actual: str, data: PreparedData, what: str) -> None:
    if actual != data.content_hash:
        raise DatasetError(
            f"the prepared data of this run ({data.uri}) was refused: the files of {what} ({folder}) hash to "
            f"{actual[:12]}..., not to the content {data.content_hash[:12]}... that prepare wrote. Someone changed "
            "them after they were stored; delete that folder and run the flow again (prepare writes them anew)"
        )


# What prepare-data hands the fit and register-model: what your code's prepare wrote (None: it reads its own data).
RunData = PreparedData


def data_dir_of(data: RunData | None, options: StorageOptions) -> Path | None:
    """The local folder of what your code's prepare wrote (``config["data_dir"]`` here); None without one."""
    return local_data_dir(data, options) if data is not None else None
