"""Open a storage URI as a pyarrow filesystem: a local path, or ``s3://bucket/prefix``.

Only the endpoint and region come from the config. S3 credentials always come from the standard AWS chain
(environment, profile, instance role) of the process that uses them, on the driver and on every Ray node
alike: they are never part of the config, and never copied to a cluster unless
`forward_credentials_to_cluster` asks for it (README, "Security and trust").
"""

from __future__ import annotations

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
        return pafs.S3FileSystem(**kwargs), f"{bucket}/{key}".rstrip("/")
    path = uri.removeprefix("file://")
    return pafs.LocalFileSystem(), str(Path(path).absolute())


def probe_storage(uri: str, options: StorageOptions) -> str:
    """Write, read back and delete a small object under ``uri`` with this process's credentials; "" when all
    three work, otherwise what failed. Runs on each Ray node before training (``tasks.cluster.check_storage_on_nodes``):
    a node has its own credentials (instance role, its own environment), and the driver's proving nothing for it."""
    import socket
    import uuid

    try:
        filesystem, path = open_filesystem(uri, options)
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
