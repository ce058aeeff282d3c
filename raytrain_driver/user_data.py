"""prepare-data for your own code: run its ``prepare(config, folder)`` and store what it wrote as a version named
by its content (raytrain_tasks/prepared.py describes the layout)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from raytrain_tasks.api import TrainFunc
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import DatasetError, UserCodeError
from raytrain_tasks.prepared import FILES_DIR, MARKER_NAME, PreparedData
from raytrain_tasks.storage.locations import DATASETS_DIR, StorageLocation, check_writable, locate


def prepare_user_data(config: TrainingConfig, spec: TrainFunc) -> PreparedData | None:
    """The stored version of what ``spec.prepare`` writes for this config (written unless that content is stored
    already); None when the code has no ``prepare``."""
    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.user_code import user_config, user_frames

    if spec.prepare is None:
        return None
    # Storage first: a wrong bucket or bad credentials fail in seconds, before the user's code loads anything.
    root = locate(config.storage_path, config.storage_options)
    check_writable(root, create_bucket=config.create_bucket)
    with tempfile.TemporaryDirectory(prefix="prt-prepare-") as scratch:
        folder = Path(scratch)
        try:
            spec.prepare(user_config(config, spec), folder)
        except Exception as exc:
            raise UserCodeError(f"train_code {config.train_code!r}: prepare failed: {user_frames(exc)}") from exc
        files = [path for path in folder.rglob("*") if path.is_file()]
        if not files:
            raise DatasetError(
                f"train_code {config.train_code!r}: prepare(config, folder) wrote no file into the folder it was "
                "given; write the run's data there (or leave prepare out and read the data in your own code)"
            )
        content_hash = local_folder_digest(folder)
        target = root.child(DATASETS_DIR, content_hash)
        data = PreparedData(
            uri=target.uri,
            content_hash=content_hash,
            source=config.train_code,
            files=len(files),
            bytes=sum(path.stat().st_size for path in files),
        )
        if not _stored(target, data):
            _store(folder, files, target, data)
    return data


def _stored(target: StorageLocation, data: PreparedData) -> bool:
    """Whether the version is complete in storage (its marker, written last, names this content)."""
    marker = target.child(MARKER_NAME)
    if not marker.exists():
        return False
    try:
        return PreparedData.model_validate_json(marker.read_text()).content_hash == data.content_hash
    except ValueError:
        return False  # a marker that is not one: the version is written again


def _store(folder: Path, files: list[Path], target: StorageLocation, data: PreparedData) -> None:
    """Every file, then the marker. What an interrupted write of this same content left is replaced: the folder's
    name says what belongs in it, and nothing reads a version without its marker."""
    destination = target.child(FILES_DIR)
    destination.filesystem.create_dir(destination.path, recursive=True)
    destination.filesystem.delete_dir_contents(destination.path, missing_dir_ok=True)
    for path in files:
        relative = path.relative_to(folder).as_posix()
        parent = relative.rpartition("/")[0]
        if parent:
            destination.filesystem.create_dir(destination.child(parent).path, recursive=True)
        destination.child(relative).write_bytes(path.read_bytes())
    target.child(MARKER_NAME).write_text(data.model_dump_json(indent=1))
