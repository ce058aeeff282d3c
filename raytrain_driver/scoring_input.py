"""A scoring run's input, read before anything is scored: its files (a CSV or Parquet file, or a folder of them),
their columns and types, the SHA-256 of their bytes, and what each file was (size, time) so a change during the
run is found before its output is committed. A CSV file's key column is read as text: `00123` stays `00123`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_tasks.errors import ScoringInputError
from raytrain_tasks.redact import redact_uri
from raytrain_tasks.scoring.config import ScoringConfig
from raytrain_tasks.storage.locations import StorageLocation, locate

FORMATS = {".csv": "csv", ".parquet": "parquet"}
CHUNK = 1 << 20


@dataclass(frozen=True)
class InputTable:
    """The input's files, their format, columns and content hash."""

    files: tuple[str, ...]
    format: str
    columns: tuple[str, ...]
    sha256: str
    numeric: tuple[str, ...] = ()  # the columns of a number type (or true/false) in every file
    stamps: tuple[tuple[int, int], ...] = ()  # each file's (size, modification time in ns) when it was read


def read_input(config: ScoringConfig) -> InputTable:
    """The input's files (a file, or a folder's CSV or Parquet files: names starting with "." or "_" are left out, as
    Parquet readers do), their columns, which every file must share, and the SHA-256 of their bytes."""
    source = locate(config.input_path, config.storage_options)
    files, format_ = _files(source, config.input_path)
    schemas = [_schema(source, path, format_, config.key_column) for path in files]
    columns = [[str(name) for name in schema.names] for schema in schemas]
    for path, names in zip(files, columns, strict=True):
        if names != columns[0]:
            raise ScoringInputError(
                f"input_path: {Path(path).name} has the columns {', '.join(names[:10])}, {Path(files[0]).name} has "
                f"{', '.join(columns[0][:10])}: every file of the input needs the same columns"
            )
    numeric = set(columns[0])
    for schema in schemas:
        numeric &= {field.name for field in schema if _is_number(field.type)}
    return InputTable(
        tuple(files),
        format_,
        tuple(columns[0]),
        _content_sha256(source, files),
        tuple(name for name in columns[0] if name in numeric),
        stamps(source, files),
    )


def _files(source: StorageLocation, given: str) -> tuple[list[str], str]:
    import pyarrow.fs as pafs

    kind = _info(source, source.path).type
    if kind == pafs.FileType.NotFound:
        raise ScoringInputError(f"input_path {redact_uri(given)} does not exist")
    if kind == pafs.FileType.File:
        files = [source.path]
    else:
        listed = source.filesystem.get_file_info(pafs.FileSelector(source.path))
        found = [info.path for info in listed if info.type == pafs.FileType.File]
        files = sorted(path for path in found if not path.rpartition("/")[2].startswith((".", "_")))
    formats = {FORMATS.get(Path(path).suffix.lower()) for path in files}
    if not files or None in formats or len(formats) != 1:
        raise ScoringInputError(
            f"input_path {redact_uri(given)}: give a CSV or Parquet file, or a folder of files of one of these kinds "
            f"(found {len(files)} files: {', '.join(Path(p).name for p in files[:5])})"
        )
    return files, formats.pop() or ""


def _info(source: StorageLocation, path: str) -> Any:
    try:
        return source.filesystem.get_file_info(path)
    except OSError as exc:
        raise ScoringInputError(
            f"input_path: cannot read {redact_uri(source.uri)} ({exc}); check input_path and the S3 settings"
        ) from exc


def csv_options(key_column: str) -> Any:
    """How a CSV input is read, here and by Ray Data: its key column as text, the others by their values."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    return pcsv.ConvertOptions(column_types={key_column: pa.string()})


def _schema(source: StorageLocation, path: str, format_: str, key_column: str) -> Any:
    """A file's Arrow schema: a Parquet file's footer, a CSV file's header and its first block's inferred types."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    try:
        if format_ == "parquet":
            with source.filesystem.open_input_file(path) as stream:
                return pq.read_schema(stream)
        with source.filesystem.open_input_stream(path) as stream:
            return pcsv.open_csv(stream, convert_options=csv_options(key_column)).schema
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ScoringInputError(f"input_path: cannot read {Path(path).name} as {format_}: {exc}") from exc


def _is_number(kind: Any) -> bool:
    import pyarrow.types as pat

    return bool(pat.is_integer(kind) or pat.is_floating(kind) or pat.is_boolean(kind))


def check_no_missing_values(config: ScoringConfig, table: InputTable, features: tuple[str, ...]) -> None:
    """A Parquet input whose footers count missing values in a feature column is refused before scoring (a CSV
    file's are found as its rows are scored, and fail the run before anything is written)."""
    import pyarrow.parquet as pq

    if table.format != "parquet":
        return
    source = locate(config.input_path, config.storage_options)
    for path in table.files:
        with source.filesystem.open_input_file(path) as stream:
            metadata = pq.ParquetFile(stream).metadata
        names = [metadata.schema.column(i).name for i in range(metadata.num_columns)]
        for group in range(metadata.num_row_groups):
            for index, name in enumerate(names):
                stats = metadata.row_group(group).column(index).statistics
                if name in features and stats is not None and stats.has_null_count and stats.null_count:
                    raise ScoringInputError(
                        f"input_path: {Path(path).name} has {stats.null_count} rows without a value in the feature "
                        f"column {name!r}: the model cannot score them. Fill or drop them first"
                    )


def stamps(source: StorageLocation, files: list[str] | tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """Each file's (size, modification time in ns), as its filesystem tells them."""
    infos = source.filesystem.get_file_info(list(files))
    return tuple((int(info.size or 0), int(info.mtime_ns or 0)) for info in infos)


def check_unchanged(config: ScoringConfig, table: InputTable) -> None:
    """ScoringInputError when a file of the input was replaced since it was hashed: the output would record the
    hash of other rows than it holds."""
    source = locate(config.input_path, config.storage_options)
    if stamps(source, table.files) != table.stamps:
        raise ScoringInputError(
            f"input_path {redact_uri(config.input_path)} changed while it was scored; nothing was written. Run again "
            "once it no longer changes"
        )


def _content_sha256(source: StorageLocation, files: list[str]) -> str:
    """SHA-256 over each file's name (relative to the input), size and SHA-256, in name order."""
    entries = []
    for path in files:
        digest, size = hashlib.sha256(), 0
        with source.filesystem.open_input_stream(path) as stream:
            while chunk := stream.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
        name = Path(path).name if len(files) == 1 else path[len(source.path) + 1 :]
        entries.append([name, size, digest.hexdigest()])
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()
