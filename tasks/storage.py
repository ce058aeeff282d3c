"""Shared storage: where datasets and checkpoints live, as a pyarrow filesystem plus a path in it.

Every consumer (Parquet I/O, Ray Train's ``RunConfig``, checkpoint downloads) gets the same pair, so a
local directory and an object store are handled by one code path.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from raytrain_tasks.errors import StorageError

DATASETS_DIR = "datasets"
RUNS_DIR = "runs"


@dataclass(frozen=True)
class StorageLocation:
    uri: str
    filesystem: pafs.FileSystem
    path: str

    def child(self, *parts: str) -> StorageLocation:
        path = "/".join([self.path.rstrip("/"), *parts])
        uri = "/".join([self.uri.rstrip("/"), *parts])
        return StorageLocation(uri, self.filesystem, path)

    def exists(self) -> bool:
        return self.filesystem.get_file_info(self.path).type != pafs.FileType.NotFound

    def read_text(self) -> str:
        with self.filesystem.open_input_stream(self.path) as stream:
            return stream.read().decode()

    def write_text(self, text: str) -> None:
        with self.filesystem.open_output_stream(self.path) as stream:
            stream.write(text.encode())

    def list_names(self) -> list[str]:
        if not self.exists():
            return []
        infos = self.filesystem.get_file_info(pafs.FileSelector(self.path, recursive=False))
        return sorted(info.base_name for info in infos)


def locate(uri: str) -> StorageLocation:
    """Resolve ``storage_path``-style strings: absolute local paths (or file:// URIs)."""
    try:
        filesystem, path = pafs.FileSystem.from_uri(uri if "://" in uri else str(Path(uri).absolute()))
    except (pafs.ArrowInvalid, OSError, ValueError) as exc:
        raise StorageError(f"cannot open storage {uri!r}: {exc}; check `storage_path`") from exc
    return StorageLocation(uri.removeprefix("file://"), filesystem, path)


def check_writable(location: StorageLocation) -> None:
    """Create the root if needed and prove a write/read/delete round trip works, before any worker starts."""
    probe = location.child(f".write-probe-{uuid.uuid4().hex[:8]}")
    try:
        location.filesystem.create_dir(location.path, recursive=True)
        probe.write_text("ok")
        if probe.read_text() != "ok":
            raise StorageError(f"storage {location.uri} returned different bytes than were written")
        location.filesystem.delete_file(probe.path)
    except OSError as exc:
        raise StorageError(
            f"storage {location.uri} is not writable ({exc}); set `storage_path` to a directory "
            "this process and every Ray node can write"
        ) from exc


def download_dir(location: StorageLocation, destination: Path) -> Path:
    """Copy a storage folder (e.g. a checkpoint) to a local directory."""
    destination.mkdir(parents=True, exist_ok=True)
    try:
        pafs.copy_files(
            location.path,
            str(destination),
            source_filesystem=location.filesystem,
            destination_filesystem=pafs.LocalFileSystem(),
        )
    except OSError as exc:
        raise StorageError(f"cannot download {location.uri}: {exc}") from exc
    return destination
