"""Open a storage URI as a pyarrow filesystem: a local path, or ``s3://bucket/prefix``.

Only the endpoint and region come from the config. S3 credentials always come from the standard AWS chain
(environment, profile, instance role) of the process that uses them, on the driver and on every Ray node
alike: they are never part of the config, and never copied to a cluster unless
`forward_credentials_to_cluster` asks for it (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict

DEFAULT_S3_REGION = "us-east-1"


class StorageOptions(BaseModel):
    """Where S3 is; empty means the AWS default."""

    model_config = ConfigDict(frozen=True)

    endpoint_url: str = ""
    region: str = ""
    # Tries per S3 request (AWS standard retry mode: exponential backoff, capped at 20 s between tries).
    max_attempts: int = 8


def s3_endpoint_and_region(endpoint_url: str, region: str, environ: Mapping[str, str]) -> tuple[str, str]:
    """The S3 endpoint and region as set, else as the AWS environment variables give them ("" for AWS's own)."""
    endpoint = endpoint_url or environ.get("AWS_ENDPOINT_URL_S3", "") or environ.get("AWS_ENDPOINT_URL", "")
    return endpoint, region or environ.get("AWS_REGION", "") or environ.get("AWS_DEFAULT_REGION", "")


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.strip("/")


def open_filesystem(uri: str, options: StorageOptions) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding ``uri`` and the path of ``uri`` inside it."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        kwargs: dict[str, object] = {"region": options.region or DEFAULT_S3_REGION}
        if options.endpoint_url:
            endpoint = urlparse(options.endpoint_url)
            # pyarrow wants host:port without the scheme, and the scheme on its own.
            kwargs["endpoint_override"] = endpoint.netloc or endpoint.path
            kwargs["scheme"] = endpoint.scheme or "https"
        return RetryingS3FileSystem(options.max_attempts, **kwargs), f"{bucket}/{key}".rstrip("/")
    path = uri.removeprefix("file://")
    return pafs.LocalFileSystem(), str(Path(path).absolute())


class RetryingS3FileSystem(pafs.S3FileSystem):
    """pyarrow's S3 filesystem with a retry strategy that survives pickling.

    Ray Train pickles ``RunConfig.storage_filesystem`` to its controller and every worker, and pyarrow's own
    ``S3FileSystem.__reduce__`` (pyarrow 25) leaves the retry strategy out: the copy on a worker, where every
    checkpoint is uploaded, falls back to 3 tries over about 2 s, so a storage blip fails the epoch. This class
    rebuilds itself with the same number of tries wherever it is unpickled. It holds no credential: those come
    from the AWS chain of the process that uses it (module docstring).
    """

    def __init__(self, max_attempts: int, **kwargs: object) -> None:
        super().__init__(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max_attempts), **kwargs)
        self._max_attempts = max_attempts
        self._kwargs = kwargs

    @property
    def max_attempts(self) -> int:
        return self._max_attempts

    def __reduce__(self) -> tuple[object, tuple[int, dict[str, object]]]:  # type: ignore[override]
        return _rebuild_s3, (self._max_attempts, self._kwargs)


def _rebuild_s3(max_attempts: int, kwargs: dict[str, object]) -> RetryingS3FileSystem:
    return RetryingS3FileSystem(max_attempts, **kwargs)


def probe_storage(uri: str, options: StorageOptions) -> str:
    """Write, read back and delete a small object under ``uri`` with this process's credentials; "" when all
    three work, otherwise what failed. Runs on each Ray node before training
    (``raytrain_driver.cluster.check_storage_on_nodes``): a node has its own credentials (instance role, its own
    environment), and the driver's proving nothing for it."""
    import socket
    import uuid

    try:
        # A probe answers in seconds: a node that cannot reach storage is reported, not retried for a minute.
        filesystem, path = open_filesystem(uri, options.model_copy(update={"max_attempts": 2}))
        probe = f"{path}/.node-probe-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        filesystem.create_dir(path, recursive=True)
        with filesystem.open_output_stream(probe) as stream:
            stream.write(b"ok")
        with filesystem.open_input_stream(probe) as stream:
            if stream.read() != b"ok":
                return "read back different bytes than were written"
        filesystem.delete_file(probe)
    except (OSError, ValueError) as exc:  # pyarrow raises OSError subclasses for S3 and local errors alike
        return f"{type(exc).__name__}: {exc}"
    return ""
