"""Shared storage: where datasets and checkpoints live, as a pyarrow filesystem plus a path in it.

Every consumer (Parquet I/O, Ray Train's ``RunConfig``, checkpoint downloads) gets the same pair, so a
local directory and an S3 bucket are handled by one code path. boto3 is the S3 client for the project's own
checks: before any worker starts, ``check_writable`` proves the bucket exists (or creates it), the
credentials work, and a small write/read/delete round trip succeeds.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from raytrain_tasks.errors import StorageError
from raytrain_tasks.storage import folder_cas
from raytrain_tasks.storage.filesystem import StorageOptions, is_s3, open_filesystem, split_s3

DATASETS_DIR = "datasets"
RUNS_DIR = "runs"


@dataclass(frozen=True)
class StorageLocation:
    uri: str
    filesystem: pafs.FileSystem
    path: str
    options: StorageOptions = StorageOptions()

    def child(self, *parts: str) -> StorageLocation:
        path = "/".join([self.path.rstrip("/"), *parts])
        uri = "/".join([self.uri.rstrip("/"), *parts])
        return StorageLocation(uri, self.filesystem, path, self.options)

    def exists(self) -> bool:
        return self.filesystem.get_file_info(self.path).type != pafs.FileType.NotFound

    def read_text(self) -> str:
        with self.filesystem.open_input_stream(self.path) as stream:
            return stream.read().decode()

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def write_bytes(self, data: bytes) -> None:
        """Replace the object whole: a reader sees the old bytes or the new ones, never a part. A local file is
        written under a temporary name and renamed over the old one (a reader that has it open keeps reading the
        old file: a second prepare-data of the same version under a running fit's workers truncated it); an S3
        object is replaced whole by the PUT that ends the upload."""
        if is_s3(self.uri):
            with self.filesystem.open_output_stream(self.path) as stream:
                stream.write(data)
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        folder_cas.replace_file(self.path, data)

    def list_names(self) -> list[str]:
        if not self.exists():
            return []
        infos = self.filesystem.get_file_info(pafs.FileSelector(self.path, recursive=False))
        return sorted(info.base_name for info in infos)

    def read_versioned(self) -> tuple[str, str] | None:
        """The object's text and a version token for ``write_if``; None when there is no object."""
        found = self.read_aged()
        return (found.text, found.version) if found is not None else None

    def read_aged(self, max_attempts: int | None = None) -> VersionedText | None:
        """The object's text, version token for ``write_if``, and age: seconds since it was last written, by the
        storage's own clock (S3: the reply's ``Date`` minus the object's ``LastModified``; a folder: its
        filesystem's, ``folder_cas``). No other host's clock enters it. None when there is no object."""
        if is_s3(self.uri):
            from botocore.exceptions import BotoCoreError, ClientError

            bucket, key = split_s3(self.uri)
            try:
                reply = s3_client(self.options, max_attempts).get_object(Bucket=bucket, Key=key)
                text = reply["Body"].read().decode()
            except ClientError as exc:
                if _code(exc) in ("NoSuchKey", "404"):
                    return None
                raise OSError(f"cannot read {self.uri}: {exc}") from exc
            except BotoCoreError as exc:  # unreachable endpoint, timeouts: the same OSError as pyarrow's
                raise OSError(f"cannot read {self.uri}: {exc}") from exc
            from email.utils import parsedate_to_datetime

            served = parsedate_to_datetime(reply["ResponseMetadata"]["HTTPHeaders"]["date"])
            return VersionedText(text, str(reply["ETag"]), (served - reply["LastModified"]).total_seconds())
        found = folder_cas.read_aged(self.path)
        return VersionedText(found[0], folder_cas.digest(found[0]), found[1]) if found is not None else None

    def delete_if(self, version: str, max_attempts: int | None = None) -> bool:
        """Delete the object only if it is still at ``version``; False when it changed (or is gone) meanwhile.
        S3: ``DeleteObject`` with ``If-Match``; a folder: under the same exclusive lock as ``write_if``."""
        if is_s3(self.uri):
            from botocore.exceptions import BotoCoreError, ClientError

            bucket, key = split_s3(self.uri)
            try:
                s3_client(self.options, max_attempts).delete_object(Bucket=bucket, Key=key, IfMatch=version)
            except ClientError as exc:
                if _code(exc) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409", "NoSuchKey", "404"):
                    return False
                raise OSError(f"cannot delete {self.uri}: {exc}") from exc
            except BotoCoreError as exc:
                raise OSError(f"cannot delete {self.uri}: {exc}") from exc
            return True
        return folder_cas.delete_if(self.path, version)

    def write_if(self, text: str, version: str | None, max_attempts: int | None = None) -> str | None:
        """Compare-and-swap: write ``text`` only if the object is still at ``version`` (None: only if there is
        none). Returns the new version, or None when another writer got there first.

        S3 does it with conditional writes (``If-None-Match: *``, ``If-Match: <ETag>``); a folder under an
        exclusive lock (``folder_cas``: on a network filesystem, one that every host sees), with the file replaced
        by a rename, so a reader never sees half of it.
        """
        if is_s3(self.uri):
            from botocore.exceptions import BotoCoreError, ClientError

            bucket, key = split_s3(self.uri)
            condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
            try:
                client = s3_client(self.options, max_attempts)
                reply = client.put_object(Bucket=bucket, Key=key, Body=text.encode(), **condition)
            except ClientError as exc:
                if _code(exc) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                    return None
                raise OSError(f"cannot write {self.uri}: {exc}") from exc
            except BotoCoreError as exc:
                raise OSError(f"cannot write {self.uri}: {exc}") from exc
            return str(reply["ETag"])
        return folder_cas.write_if(self.path, text, version)


@dataclass(frozen=True)
class VersionedText:
    text: str
    version: str
    age_s: float  # since the last write, by the storage's clock


def make_dirs(location: StorageLocation) -> list[StorageLocation]:
    """Create ``location`` as a folder; returns the folders that did not exist before, deepest first, for
    ``remove_empty_dirs`` (on S3, where folders are prefixes, the ones that had no object under them)."""
    created, current = [], location
    while not current.exists():
        created.append(current)
        parent_uri = current.uri.rsplit("/", 1)[0]
        if parent_uri in ("", current.uri) or (is_s3(current.uri) and parent_uri.count("/") < 3):
            break  # the filesystem root, or the bucket itself
        current = locate(parent_uri, location.options)
    if not is_s3(location.uri):
        location.filesystem.create_dir(location.path, recursive=True)
    return created


def remove_empty_dirs(folders: list[StorageLocation]) -> None:
    """Remove the folders ``make_dirs`` reported as new that hold nothing now, deepest first.

    On S3 pyarrow leaves an empty ``prefix/`` marker object behind when it deletes a folder's last file; those
    markers are what is removed there, through boto3 (pyarrow would write a marker for the parent instead).
    """
    for folder in folders:
        if not is_s3(folder.uri):
            if Path(folder.path).is_dir():
                folder_cas.remove_empty_folder(folder.path)  # a network folder's lock file goes with it
            continue
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, prefix = split_s3(folder.uri)
        client = s3_client(folder.options)
        try:
            listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
            keys = [o["Key"] for o in listed]
            if keys and all(key.endswith("/") for key in keys):
                client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": key} for key in keys]})
        except (BotoCoreError, ClientError) as exc:
            raise OSError(f"cannot tidy {folder.uri}: {exc}") from exc


def locate(uri: str, options: StorageOptions | None = None) -> StorageLocation:
    """Resolve a ``storage_path``-style string: a local path, a file:// URI, or s3://bucket/prefix."""
    options = options or StorageOptions()
    try:
        filesystem, path = open_filesystem(uri, options)
    except (pafs.ArrowInvalid, OSError, ValueError) as exc:
        raise StorageError(f"cannot open storage {uri!r}: {exc}; check `storage_path`") from exc
    if not is_s3(uri):
        uri = path
    return StorageLocation(uri.rstrip("/"), filesystem, path, options)


def check_writable(location: StorageLocation, *, create_bucket: bool = False) -> None:
    """Before any worker starts: the storage exists (or is created) and a write/read/delete round trip works."""
    if is_s3(location.uri):
        _check_s3(location, create_bucket=create_bucket)
        return
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


def s3_client(options: StorageOptions, max_attempts: int | None = None, read_timeout: int = 10) -> Any:
    """A boto3 S3 client trying each request ``options.max_attempts`` times (``s3_max_attempts``) with AWS's
    standard backoff, or ``max_attempts`` where the caller retries on its own schedule or must answer in
    seconds (the pre-flight check, the run lease); ``read_timeout``: seconds to wait for an answer."""
    import boto3
    from botocore.config import Config

    # A fresh session: boto3's default one caches the credentials it first resolved, so a long-lived
    # process would keep using rotated-out keys.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=options.endpoint_url or None,
        region_name=options.region or None,
        config=Config(
            connect_timeout=3,
            read_timeout=read_timeout,
            retries={"total_max_attempts": max_attempts or options.max_attempts, "mode": "standard"},
        ),
    )


def create_bucket_in_region(client: Any, bucket: str) -> None:
    """Create ``bucket`` in the client's region (``s3_region``): outside us-east-1, AWS refuses a CreateBucket
    that does not name its region as the LocationConstraint."""
    region = client.meta.region_name
    if region and region != "us-east-1":
        client.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": region})
    else:
        client.create_bucket(Bucket=bucket)


def _check_s3(location: StorageLocation, *, create_bucket: bool) -> None:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, prefix = split_s3(location.uri)
    where = f"s3://{bucket} at {location.options.endpoint_url or 'AWS'}"
    client = s3_client(location.options, max_attempts=2)  # a pre-flight check answers in seconds
    probe_key = "/".join(p for p in (prefix, f".write-probe-{uuid.uuid4().hex[:8]}") if p)
    try:
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError as exc:
            if _code(exc) not in ("404", "NoSuchBucket"):
                raise
            if not create_bucket:
                raise StorageError(
                    f"bucket {bucket!r} does not exist ({where}); create it, set `create_bucket` to true, "
                    "or fix `storage_path`"
                ) from exc
            create_bucket_in_region(client, bucket)
        client.put_object(Bucket=bucket, Key=probe_key, Body=b"ok")
        if client.get_object(Bucket=bucket, Key=probe_key)["Body"].read() != b"ok":
            raise StorageError(f"{where} returned different bytes than were written")
        client.delete_object(Bucket=bucket, Key=probe_key)
    except NoCredentialsError as exc:
        raise StorageError(
            f"no AWS credentials found for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE, in the environment of this process and of the Ray nodes"
        ) from exc
    except ClientError as exc:
        raise StorageError(_explain_client_error(exc, where, bucket, prefix)) from exc
    except BotoCoreError as exc:
        raise StorageError(
            f"cannot reach {where} ({exc}); check `s3_endpoint_url` (or AWS_ENDPOINT_URL) and that the server is up"
        ) from exc


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _explain_client_error(exc: Any, where: str, bucket: str, prefix: str) -> str:
    code = _code(exc)
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidClientTokenId", "ExpiredToken"):
        return (
            f"{where} rejected the credentials ({code}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        )
    if code in ("403", "AccessDenied", "Forbidden"):
        return (
            f"access denied on s3://{bucket}/{prefix} ({code}): the credentials are unknown or lack "
            "s3:ListBucket/GetObject/PutObject/DeleteObject there; check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, the bucket policy, or `storage_path`"
        )
    return f"{where} refused the storage check ({code}: {exc}); check `storage_path` and the S3 settings"


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
