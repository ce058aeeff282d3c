"""Checkpoint upload to a local S3 server: our path (pyarrow, as Ray Train uploads) vs raw boto3 put_object.

    python -m bench.checkpoint_upload [--repeats 5]

Prints the checkpoint size, median seconds and MB/s for each, and their ratio. Starts and stops its own
SeaweedFS server on a free port.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs
import torch

from bench.summary import write_figures
from devtools.s3_server import ADMIN, LocalS3
from raytrain_tasks.storage.filesystem import StorageOptions, open_filesystem
from raytrain_tasks.storage.locations import s3_client
from raytrain_tasks.table_classifier.models import build_mlp
from raytrain_tasks.trainspec.checkpoint import capture_rng_state

BUCKET = "bench"


def make_checkpoint(directory: Path, hidden: list[int]) -> int:
    """A checkpoint as a TrainSpec's loop writes one (raytrain_tasks.trainspec.loop): model, optimizer and RNG state."""
    from raytrain_tasks.trainspec.loop import STATE_FILE

    model = build_mlp(64, 10, hidden)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    directory.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": capture_rng_state(), "epoch": 0}
    torch.save(state | {"data_sha256": ""}, directory / STATE_FILE)
    return sum(p.stat().st_size for p in directory.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = ADMIN
    print(f"machine: {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="prt-bench-") as tmp:
        server = LocalS3(Path(tmp) / "s3").start()
        try:
            options = StorageOptions(endpoint_url=server.endpoint_url)
            client = s3_client(options)
            client.create_bucket(Bucket=BUCKET)
            filesystem, _ = open_filesystem(f"s3://{BUCKET}/x", options)
            sizes = []
            for hidden in ([128, 64], [1024, 1024], [4096, 4096]):
                source = Path(tmp) / f"ckpt-{hidden[0]}"
                size = make_checkpoint(source, hidden)
                ours, raw = [], []
                for i in range(args.repeats):
                    started = time.perf_counter()
                    pafs.copy_files(
                        str(source),
                        f"{BUCKET}/pyarrow/{hidden[0]}/{i}",
                        source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=filesystem,
                    )
                    ours.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    for path in source.iterdir():
                        client.put_object(
                            Bucket=BUCKET, Key=f"boto3/{hidden[0]}/{i}/{path.name}", Body=path.read_bytes()
                        )
                    raw.append(time.perf_counter() - started)
                t_ours, t_raw = statistics.median(ours), statistics.median(raw)
                mb = size / 1e6
                print(
                    f"mlp {hidden}: checkpoint {mb:7.2f} MB"
                    f" | pyarrow (Ray's path) {t_ours:6.3f} s {mb / t_ours:7.1f} MB/s"
                    f" | boto3 put_object {t_raw:6.3f} s {mb / t_raw:7.1f} MB/s"
                    f" | throughput ratio {t_raw / t_ours:4.2f}x"
                )
                sizes.append({"mb": mb, "pyarrow_s": t_ours, "boto3_s": t_raw, "throughput_ratio": t_raw / t_ours})
        finally:
            server.stop()
    print(f"written: {write_figures('checkpoint_upload', {'sizes': sizes, 'repeats': args.repeats})}")


if __name__ == "__main__":
    main()
