"""prepare-data for your own code: run its ``prepare(config, folder)`` and store what it wrote as a version named
by its content (raytrain_tasks/prepared.py describes the layout)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from raytrain_tasks.api import TrainFunc
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import DatasetError, UserCodeError
from raytrain_tasks.prepared import FILES_DIR, MARKER_NAME, PreparedData
from raytrain_tasks.storage.locations import DATASETS_DIR, StorageLocation, check_writable, locate

# A local file being replaced, under its temporary name (raytrain_tasks.storage.folder_cas.replace_file).
STAGED = re.compile(r"(.+)\.[0-9a-f]{8}\.tmp")


def prepare_user_data(config: TrainingConfig, spec: TrainFunc) -> PreparedData | None:
    """The stored version of what ``spec.prepare`` writes for this config (written unless that content is stored
    already); None when the code has no ``prepare``. The run's storage is checked first, for every code
    (StorageError naming ``storage_path``)."""
    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.user_code import user_config, user_frames

    # Storage first, for every code: a wrong bucket, bad credentials or a folder that cannot be written fail here
    # in seconds, once per run (prepare-data is not retried), before the user's code loads anything and before
    # the fit takes its lease or starts a worker (there they would surface as OSErrors that Prefect retries).
    root = locate(config.storage_path, config.storage_options)
    check_writable(root, create_bucket=config.create_bucket)
    if spec.prepare is None:
        return None
    with tempfile.TemporaryDirectory(prefix="prt-prepare-") as scratch:
        folder = Path(scratch)
        try:
            said = spec.prepare(user_config(config, spec), folder)
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
            summary=summary_line(said),
        )
        if not _stored(target, data):
            _store(folder, files, target, data)
    return data


SUMMARY_CHARS = 200


def summary_line(said: object) -> str:
    """What ``prepare`` returned, as the one line a log and a run page show (its first line, at most 200
    characters, any secret in it masked); "" for None or anything that is not a string (a prepare written before
    it could return one may return what its last call did)."""
    from raytrain_tasks.redact import redact

    if not isinstance(said, str):
        return ""
    line = redact(said.strip().splitlines()[0]) if said.strip() else ""
    return line if len(line) <= SUMMARY_CHARS else line[: SUMMARY_CHARS - 3] + "..."


def _stored(target: StorageLocation, data: PreparedData) -> bool:
    """Whether the version is complete in storage: its marker (written last) names this content, and its files are
    there, as many and as large as the marker says (a folder emptied since is written again)."""
    marker = target.child(MARKER_NAME)
    if not marker.exists():
        return False
    try:
        if PreparedData.model_validate_json(marker.read_text()).content_hash != data.content_hash:
            return False
    except ValueError:
        return False  # a marker that is not one: the version is written again
    files = target.child(FILES_DIR)
    sizes = [size for name, size in _file_names(files).items() if not STAGED.fullmatch(name)]
    return len(sizes) == data.files and sum(sizes) == data.bytes


def _file_names(folder: StorageLocation) -> dict[str, int]:
    """Every file under ``folder``, by its path relative to it, with its size."""
    import pyarrow.fs as pafs

    root = folder.path.rstrip("/")
    infos = folder.filesystem.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return {info.path[len(root) + 1 :]: info.size for info in infos if info.type == pafs.FileType.File}


def _store(folder: Path, files: list[Path], target: StorageLocation, data: PreparedData) -> None:
    """Every file, each replaced whole (a reader of this same content, another run preparing it at the same time,
    sees whole files of the same bytes), then the names an interrupted write left that are not the version's, then
    the marker. Nothing reads a version without its marker."""
    destination = target.child(FILES_DIR)
    destination.filesystem.create_dir(destination.path, recursive=True)
    names = {path.relative_to(folder).as_posix() for path in files}
    for name in sorted(names):
        destination.child(name).write_bytes((folder / name).read_bytes())
    for name in _file_names(destination):
        staged = STAGED.fullmatch(name)  # another writer's file of this content, before its rename
        if name not in names and not (staged and staged.group(1) in names):
            destination.filesystem.delete_file(destination.child(name).path)
    target.child(MARKER_NAME).write_text(data.model_dump_json(indent=1))
