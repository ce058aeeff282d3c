"""Where a scoring run's predictions go: staged next to the output, then committed as one Parquet file that
appears whole or not at all (a local file is renamed into place; an S3 object appears when its upload completes).
The file's own metadata says which model version scored which input, so a rerun knows it is already written."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from enum import Enum
from typing import Any

from raytrain_tasks.storage.filesystem import is_s3
from raytrain_tasks.storage.locations import StorageLocation

# The key of the output file's Parquet metadata that records what made it.
METADATA_KEY = b"prefect_raytrain.scoring"


@dataclass(frozen=True)
class Provenance:
    """What made an output: the model version, the input's content hash, and the record of the run."""

    model: str  # the registered model's name
    version: str
    input_sha256: str
    rows: int = 0
    mlflow_run_id: str = ""

    def same_work(self, other: Provenance) -> bool:
        return (self.model, self.version, self.input_sha256) == (other.model, other.version, other.input_sha256)


class OutputAction(Enum):
    WRITE = "write"
    ALREADY_WRITTEN = "already_written"
    REFUSE = "refuse"


def output_action(found: Provenance | str | None, planned: Provenance, overwrite: bool) -> tuple[OutputAction, str]:
    """What to do with an output path that holds ``found`` (None: nothing; a text: a file this project did not
    write, or cannot read, described), before scoring ``planned``; (action, why)."""
    if found is None:
        return OutputAction.WRITE, "no output there yet"
    if isinstance(found, Provenance) and found.same_work(planned):
        return OutputAction.ALREADY_WRITTEN, (
            f"it already holds {found.rows} predictions of {found.model} version {found.version} for this input "
            f"(recorded in MLflow run {found.mlflow_run_id or '?'})"
        )
    held = (
        f"{found.model} version {found.version}'s predictions for input {found.input_sha256[:12]}"
        if isinstance(found, Provenance)
        else found
    )
    if overwrite:
        return OutputAction.WRITE, f"it holds {held}, replaced on request (overwrite)"
    return OutputAction.REFUSE, (
        f"it holds {held}, not {planned.model} version {planned.version}'s for input {planned.input_sha256[:12]}: "
        "give another output_path, or overwrite=true to replace it"
    )


def read_provenance(output: StorageLocation) -> Provenance | str | None:
    """What the output file records of itself; None when there is no file; a description when it is not one of
    this project's outputs (no such metadata) or cannot be read as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not output.exists():
        return None
    try:
        with output.filesystem.open_input_file(output.path) as stream:
            metadata = pq.read_schema(stream).metadata or {}
    except (OSError, pa.ArrowInvalid) as exc:
        return f"a file that is not Parquet ({type(exc).__name__})"
    if METADATA_KEY not in metadata:
        return "a Parquet file this project did not write"
    try:
        record = json.loads(metadata[METADATA_KEY])
        return Provenance(**{key: record[key] for key in Provenance.__dataclass_fields__ if key in record})
    except (ValueError, TypeError, KeyError):
        return "a Parquet file whose scoring record cannot be read"


def staging_location(output: StorageLocation, token: str) -> StorageLocation:
    """The folder beside the output where Ray Data writes a run's parts; a name starting with "_" is one Parquet
    readers (pyarrow, Spark, pandas) pass over, and ``token`` makes it the same for a rerun of the same work, which
    clears what a crashed attempt left there."""
    parent, _, name = output.path.rpartition("/")
    uri_parent = output.uri.rpartition("/")[0]
    return StorageLocation(
        f"{uri_parent}/_staging-{name}-{token}", output.filesystem, f"{parent}/_staging-{name}-{token}", output.options
    )


def clear(location: StorageLocation) -> None:
    import pyarrow.fs as pafs

    if location.filesystem.get_file_info(location.path).type == pafs.FileType.Directory:
        location.filesystem.delete_dir(location.path)


def commit(staging: StorageLocation, output: StorageLocation, provenance: Provenance) -> int:
    """Write the staged parts as the one output file, with ``provenance`` (and the rows) in its metadata, replacing
    what was there in one step; then remove the staging folder. The rows written."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    selector = pafs.FileSelector(staging.path, recursive=True)
    parts = sorted(info.path for info in staging.filesystem.get_file_info(selector) if info.path.endswith(".parquet"))
    tables = _parts(staging, parts)
    first = next(tables, None)
    if first is None:
        raise RuntimeError(f"the scoring run wrote no predictions under {staging.uri}")
    rows = sum(pq.ParquetFile(staging.filesystem.open_input_file(part)).metadata.num_rows for part in parts)
    record = {**provenance.__dict__, "rows": rows}
    schema = first.schema.with_metadata({METADATA_KEY: json.dumps(record).encode()})
    target = output.path if is_s3(output.uri) else f"{output.path}.tmp-{secrets.token_hex(4)}"
    with output.filesystem.open_output_stream(target) as stream, pq.ParquetWriter(stream, schema) as writer:
        for table in (first, *tables):
            writer.write_table(table.cast(schema))
    if not is_s3(output.uri):
        os.replace(target, output.path)  # a reader sees the old file or the new one, never a part
    clear(staging)
    return rows


def _parts(staging: StorageLocation, parts: list[str]) -> Any:
    """Each part's tables, tensor columns as plain Arrow lists (Ray Data's extension type is Ray's alone)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in parts:
        table = pq.read_table(staging.filesystem.open_input_file(part))
        if table.num_rows == 0:
            continue
        columns = [
            column.combine_chunks().storage if isinstance(column.type, pa.ExtensionType) else column
            for column in table.columns
        ]
        yield pa.table(columns, names=table.column_names)
