"""Where a scoring run's predictions go: staged next to the output, then committed as one Parquet file that
appears whole or not at all (a local file is renamed into place; an S3 object appears when its upload completes).
The file's own metadata says which model version scored which input, so a rerun knows it is already written."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from enum import Enum
from typing import Any

from raytrain_tasks.errors import ScoringInputError
from raytrain_tasks.redact import redact, redact_uri
from raytrain_tasks.storage.filesystem import is_s3, split_s3
from raytrain_tasks.storage.locations import StorageLocation

logger = logging.getLogger(__name__)

# The key of the output file's Parquet metadata that records what made it.
METADATA_KEY = b"prefect_raytrain.scoring"
STAGING_PREFIX = "_staging-"
STAGED_OUTPUT = "_output.parquet"  # the whole output, written in the staging folder before it is put in place


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
    this project's outputs (no such metadata) or not Parquet. ScoringInputError naming `output_path` when what is
    there cannot be read (no access, an outage): not evidence that it may be replaced."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if not output.exists():
            return None
        with output.filesystem.open_input_file(output.path) as stream:
            metadata = pq.read_schema(stream).metadata or {}
    except pa.ArrowInvalid as exc:
        return f"a file that is not Parquet ({type(exc).__name__})"
    except OSError as exc:
        raise ScoringInputError(
            f"output_path {redact_uri(output.uri)}: cannot read what is there ({redact(str(exc))}); check "
            "output_path and the S3 settings"
        ) from exc
    if METADATA_KEY not in metadata:
        return "a Parquet file this project did not write"
    try:
        record = json.loads(metadata[METADATA_KEY])
        return Provenance(**{key: record[key] for key in Provenance.__dataclass_fields__ if key in record})
    except (ValueError, TypeError, KeyError):
        return "a Parquet file whose scoring record cannot be read"


def staging_location(output: StorageLocation, work: str, attempt: str) -> StorageLocation:
    """The folder beside the output where one attempt's parts are written; a name starting with "_" is one Parquet
    readers (pyarrow, Spark, pandas) pass over. ``work`` names what is scored (the same for a rerun, which clears
    what earlier attempts of it left once it has committed); ``attempt``, this attempt."""
    parent, _, name = output.path.rpartition("/")
    folder = f"{STAGING_PREFIX}{name}-{work}-{attempt}"
    uri = f"{output.uri.rpartition('/')[0]}/{folder}"
    return StorageLocation(uri, output.filesystem, f"{parent}/{folder}", output.options)


def clear(location: StorageLocation) -> None:
    import pyarrow.fs as pafs

    if location.filesystem.get_file_info(location.path).type == pafs.FileType.Directory:
        location.filesystem.delete_dir(location.path)


# A staging folder of the same work with nothing written for this long is a crashed attempt's, not a live one's.
STALE_AFTER_S = 24 * 3600.0


def clear_attempts(output: StorageLocation, work: str, now: float, stale_after_s: float = STALE_AFTER_S) -> list[str]:
    """Remove the staging folders of ``work`` beside the output that nothing was written to for ``stale_after_s``:
    what crashed attempts left. A concurrent attempt of the same work keeps its own. The folders removed."""
    import pyarrow.fs as pafs

    parent, _, name = output.path.rpartition("/")
    prefix = f"{STAGING_PREFIX}{name}-{work}-"
    removed = []
    for info in output.filesystem.get_file_info(pafs.FileSelector(parent, allow_not_found=True)):
        if info.type != pafs.FileType.Directory or not info.base_name.startswith(prefix):
            continue
        inside = output.filesystem.get_file_info(pafs.FileSelector(info.path, recursive=True))
        newest = max((f.mtime.timestamp() for f in inside if f.mtime is not None), default=0.0)
        if now - newest >= stale_after_s:
            output.filesystem.delete_dir(info.path)
            removed.append(info.base_name)
    return removed


def commit(staging: StorageLocation, output: StorageLocation, provenance: Provenance) -> int:
    """Write the staged parts as one file, with ``provenance`` (and the rows) in its metadata, inside the staging
    folder; then put it in place in one step: a local file is renamed over the output, an S3 object copied to it
    on the server (it appears whole when the copy completes). A failure before that leaves the output as it was.
    The rows written."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    selector = pafs.FileSelector(staging.path, recursive=True)
    parts = sorted(
        info.path
        for info in staging.filesystem.get_file_info(selector)
        if info.path.endswith(".parquet") and not info.base_name.startswith("_")
    )
    rows = 0
    for part in parts:
        with staging.filesystem.open_input_file(part) as stream:
            rows += pq.ParquetFile(stream).metadata.num_rows
    tables = _parts(staging, parts)
    first = next(tables, None)
    if first is None:
        raise RuntimeError(f"the scoring run wrote no predictions under {staging.uri}")
    record = {**provenance.__dict__, "rows": rows}
    schema = first.schema.with_metadata({METADATA_KEY: json.dumps(record).encode()})
    written, whole = 0, f"{staging.path}/{STAGED_OUTPUT}"
    with staging.filesystem.open_output_stream(whole) as stream, pq.ParquetWriter(stream, schema) as writer:
        for table in (first, *tables):
            writer.write_table(table.cast(schema))  # a part of other types fails here, before anything is published
            written += table.num_rows
    if written != rows:
        raise RuntimeError(f"{written} predictions written of the {rows} staged under {staging.uri}")
    if is_s3(output.uri):
        staged = StorageLocation(f"{staging.uri}/{STAGED_OUTPUT}", staging.filesystem, whole, staging.options)
        publish_on_s3(staged, output)
    else:
        os.replace(whole, output.path)  # a reader sees the old file or the new one, never a part
    try:  # the output is in place: what is left to tidy costs nothing if it fails
        clear(staging)
    except OSError as exc:
        logger.warning("the output is written; could not remove its staging folder %s: %s", staging.uri, exc)
    return rows


# S3 copies at most 5 GiB in one request (CopyObject); a larger output is copied in parts of at least COPY_PART
# bytes (UploadPartCopy, at most MAX_PARTS), and like a single copy it appears only when the upload completes.
SINGLE_COPY_LIMIT = 5 * 1024**3
COPY_PART = 512 * 1024**2
MAX_PARTS = 10_000
# A server may answer a part's copy only once it is done: the wait for one part's answer (boto3's default, and
# this project's for other requests, is a few seconds).
COPY_READ_TIMEOUT_S = 600


def publish_on_s3(staged: StorageLocation, output: StorageLocation) -> None:
    """Copy the staged output object to the output on the server, whole or not at all."""
    size = staged.filesystem.get_file_info(staged.path).size or 0
    if size <= SINGLE_COPY_LIMIT:
        output.filesystem.copy_file(staged.path, output.path)
        return
    from raytrain_tasks.storage.locations import s3_client

    part = max(COPY_PART, -(-size // MAX_PARTS))
    client = s3_client(output.options, read_timeout=COPY_READ_TIMEOUT_S)
    copy_in_parts(client, staged.uri, output.uri, size, part)


def copy_in_parts(client: Any, source_uri: str, target_uri: str, size: int, part: int) -> None:
    """A multipart upload of ``target_uri`` whose parts are server-side copies of ``source_uri``'s byte ranges;
    any failure aborts it, so nothing is published and no parts are left billed."""
    from botocore.exceptions import BotoCoreError, ClientError

    source_bucket, source_key = split_s3(source_uri)
    bucket, key = split_s3(target_uri)
    upload = None
    try:
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        parts = []
        for number, start in enumerate(range(0, size, part), start=1):
            copied = client.upload_part_copy(
                Bucket=bucket,
                Key=key,
                UploadId=upload,
                PartNumber=number,
                CopySource={"Bucket": source_bucket, "Key": source_key},
                CopySourceRange=f"bytes={start}-{min(start + part, size) - 1}",
            )
            parts.append({"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]})
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
        upload = None
    except (BotoCoreError, ClientError) as exc:
        where = redact_uri(target_uri)
        raise OSError(f"output_path: could not copy the predictions to {where}: {redact(str(exc))}") from exc
    finally:
        if upload is not None:  # begun, not completed: a failure, or a stop (Ctrl-C, a cancellation) midway
            _abort(client, bucket, key, upload)


def _abort(client: Any, bucket: str, key: str, upload: str) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
    except (BotoCoreError, ClientError) as exc:  # the bucket's lifecycle rule for incomplete uploads is left
        logger.warning("could not abort the unfinished copy to s3://%s/%s: %s", bucket, key, redact(str(exc)))


def _parts(staging: StorageLocation, parts: list[str]) -> Any:
    """Each part's tables, tensor columns as plain Arrow lists (Ray Data's extension type is Ray's alone)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in parts:
        with staging.filesystem.open_input_file(part) as stream:
            table = pq.read_table(stream)
        if table.num_rows == 0:
            continue
        columns = [
            column.combine_chunks().storage if isinstance(column.type, pa.ExtensionType) else column
            for column in table.columns
        ]
        yield pa.table(columns, names=table.column_names)
