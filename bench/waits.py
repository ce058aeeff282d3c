"""How long a user waits for an unreachable or refusing service to be named, and when a lease counts as lost.

    python -m bench.waits

The tests assert what happens (the error names the setting, nothing is created, the logger keeps going, the lease
holder stops before its lease could expire anywhere); this prints how many seconds each of those takes, against the
targets in bench/summary.py. Real components only: a SeaweedFS S3 server on 127.0.0.1, a closed port or a listener
that never answers for Ray, a closed port for MLflow.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.summary import write_figures

# Each figure and the most a user should wait for it (seconds); bench/summary.py reads both.
TARGETS_S = {
    "s3 preflight": 15.0,
    "mlflow epoch logger, server down": 30.0,
    "ray_address: closed port": 10.0,
    "ray_address: silent listener": 30.0,
}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _seconds(call: Callable[[], Any]) -> tuple[float, str]:
    """Seconds until ``call`` returns or raises, and what it raised ('' when it returned)."""
    started = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error is the figure's subject, printed beside it
        return time.monotonic() - started, f"{type(exc).__name__}: {str(exc)[:90]}"
    return time.monotonic() - started, ""


def _s3_preflight(workdir: Path) -> list[dict[str, Any]]:
    from devtools.s3_server import ADMIN, READER, LocalS3
    from raytrain_driver.preflight import resolve_code
    from raytrain_driver.user_data import prepare_user_data
    from raytrain_tasks.config import TrainingConfig
    from raytrain_tasks.storage.filesystem import StorageOptions
    from raytrain_tasks.storage.locations import s3_client

    server = LocalS3(workdir / "s3").start()
    saved = {name: os.environ.get(name) for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    rows = []
    try:
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = ADMIN
        s3_client(StorageOptions(endpoint_url=server.endpoint_url)).create_bucket(Bucket="prt-bench")
        cases: dict[str, tuple[dict[str, Any], tuple[str, str]]] = {
            "no bucket (create_bucket=False)": ({"storage_path": "s3://prt-missing/d", "create_bucket": False}, ADMIN),
            "bad credentials": ({}, (ADMIN[0], "not-the-secret")),
            "no write permission": ({"storage_path": "s3://prt-bench/readonly"}, READER),
            "s3_endpoint_url: closed port": ({"s3_endpoint_url": f"http://127.0.0.1:{_closed_port()}"}, ADMIN),
        }
        for number, (case, (overrides, keys)) in enumerate(cases.items()):
            os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = keys
            values: dict[str, Any] = {
                "train_config": {"dataset": "synthetic"},
                "storage_path": f"s3://prt-bench/case-{number}",
                "s3_endpoint_url": server.endpoint_url,
                "create_bucket": True,
                "mlflow_tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}",
            }
            config = TrainingConfig(**(values | overrides))
            seconds, error = _seconds(partial(prepare_user_data, config, resolve_code(config)))
            rows.append({"figure": "s3 preflight", "case": case, "seconds": seconds, "error": error})
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()
    return rows


def _mlflow_logger(workdir: Path) -> dict[str, Any]:
    from mlflow import MlflowClient

    from raytrain_tasks.tracking.controller import MlflowEpochLogger

    class Checkpoint:
        path = str(workdir / "runs" / "key" / "epoch-0000")

    db = f"sqlite:///{workdir / 'logger.db'}"
    client = MlflowClient(db)
    run_id = client.create_run(client.create_experiment("waits")).info.run_id
    logger = MlflowEpochLogger(f"http://127.0.0.1:{_closed_port()}", run_id)
    epoch = [{"epoch": 0, "train_loss": 1.0, "val_loss": 1.0, "val_accuracy": 0.5}]
    seconds, error = _seconds(lambda: logger.after_report(None, epoch, Checkpoint()))  # type: ignore[arg-type]
    return {"figure": "mlflow epoch logger, server down", "case": "one report", "seconds": seconds, "error": error}


def _ray_address() -> list[dict[str, Any]]:
    from raytrain_driver.cluster import check_reachable, ray_session
    from raytrain_tasks.config import TrainingConfig

    closed, error = _seconds(lambda: check_reachable(f"127.0.0.1:{_closed_port()}"))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    held: list[Any] = []

    def accept_and_hold() -> None:  # accepts every connection and never answers
        try:
            while True:
                held.append(listener.accept())
        except OSError:  # closed once the figure is taken
            return

    threading.Thread(target=accept_and_hold, daemon=True).start()

    def connect() -> None:
        with ray_session(TrainingConfig(ray_address=f"127.0.0.1:{port}", ray_connect_timeout_s=5)):
            pass

    silent, silent_error = _seconds(connect)
    listener.close()
    return [
        {"figure": "ray_address: closed port", "case": "check_reachable", "seconds": closed, "error": error},
        {
            "figure": "ray_address: silent listener",
            "case": "ray_connect_timeout_s=5",
            "seconds": silent,
            "error": silent_error,
        },
    ]


def _lease(workdir: Path) -> dict[str, Any]:
    """A 6 s lease on S3 whose storage goes away: when the holder counts it lost, as a fraction of the lease."""
    from devtools.s3_server import ADMIN, LocalS3
    from raytrain_driver.lease import run_lease
    from raytrain_tasks.storage.filesystem import StorageOptions
    from raytrain_tasks.storage.locations import locate, s3_client

    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = ADMIN
    server = LocalS3(workdir / "lease-s3").start()
    try:
        options = StorageOptions(endpoint_url=server.endpoint_url)
        s3_client(options).create_bucket(Bucket="prt-lease")
        with run_lease(locate("s3://prt-lease/runs", options).child("key"), "key", "bench", 6) as lease:
            server.stop()
            lease.lost_event.wait(timeout=12)
            lost_after = time.monotonic() - lease.renewed_at
    finally:
        server.stop()
    return {"figure": "lease counted lost", "case": "6 s lease, storage down", "fraction": lost_after / 6}


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="prt-bench-waits-") as tmp:
        workdir = Path(tmp)
        rows = _s3_preflight(workdir) + [_mlflow_logger(workdir)] + _ray_address()
        lease = _lease(workdir)
    print("\n| what | case | seconds | target (s) | error |")
    print("|---|---|---:|---:|---|")
    for row in rows:
        target = TARGETS_S[row["figure"]]
        print(f"| {row['figure']} | {row['case']} | {row['seconds']:.1f} | {target:g} | {row['error']} |")
    print(f"| lease counted lost | {lease['case']} | {lease['fraction']:.2f} of the lease | 0.75-1.0 | |")
    print(f"written: {write_figures('waits', {'rows': rows, 'targets_s': TARGETS_S, 'lease': lease})}")


if __name__ == "__main__":
    main()
