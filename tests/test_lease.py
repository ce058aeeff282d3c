"""One driver per run key: the lease in the run's storage folder."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from raytrain_tasks.errors import RunLeaseError
from raytrain_tasks.fs import StorageOptions
from tasks.lease import LEASE_FILE, read_lease, run_lease
from tasks.storage import StorageLocation, locate, s3_client
from tasks.tracking import driver_alive, this_driver

KEY = "20261123-070000-abcdef"


def _lease_file(tmp_path: Path, holder: str, expires_in: float) -> Path:
    path = tmp_path / KEY / LEASE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"holder": holder, "expires_at": time.time() + expires_in}))
    return path


def test_a_live_holder_keeps_the_run_and_the_refusal_says_who_and_until_when(tmp_path: Path) -> None:
    _lease_file(tmp_path, "other-host:4242:99", expires_in=60)
    with pytest.raises(RunLeaseError, match=r"driven by other-host:4242:99 until \d{4}-\d\d-\d\d") as refused:
        with run_lease(locate(str(tmp_path)).child(KEY), KEY, this_driver(), 60, holder_alive=driver_alive):
            pytest.fail("entered a run another driver holds")
    assert "resume" in str(refused.value)
    lease = read_lease(locate(str(tmp_path / KEY / LEASE_FILE)))
    assert lease is not None and lease.holder == "other-host:4242:99"  # untouched


def test_an_expired_lease_and_a_dead_holder_on_this_host_are_taken_over(tmp_path: Path) -> None:
    run_dir = locate(str(tmp_path)).child(KEY)
    _lease_file(tmp_path, "other-host:4242:99", expires_in=-1)
    with run_lease(run_dir, KEY, this_driver(), 60, holder_alive=driver_alive):
        assert read_lease(run_dir.child(LEASE_FILE)).holder == this_driver()  # type: ignore[union-attr]

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = this_driver().replace(f":{os.getpid()}:", f":{finished.pid}:")
    finished.wait()
    assert driver_alive(dead) is False
    _lease_file(tmp_path, dead, expires_in=600)
    with run_lease(run_dir, KEY, this_driver(), 60, holder_alive=driver_alive):
        pass
    assert not (tmp_path / KEY / LEASE_FILE).exists()  # released on exit


def test_the_holder_renews_its_lease_and_releases_it(tmp_path: Path) -> None:
    run_dir = locate(str(tmp_path)).child(KEY)
    refusals: list[str] = []
    with run_lease(run_dir, KEY, "holder-a", 1.5):
        for _ in range(3):  # twice the lease's length: only renewals keep it
            time.sleep(1.0)
            try:
                with run_lease(run_dir, KEY, "holder-b", 1.5):
                    pytest.fail("a second driver got a renewed lease")
            except RunLeaseError as exc:
                refusals.append(str(exc))
    assert len(refusals) == 3 and all("holder-a" in r for r in refusals)
    with run_lease(run_dir, KEY, "holder-b", 1.5):
        pass


def _race(run_dir: StorageLocation, holders: tuple[str, str]) -> list[str]:
    """Two drivers released by one barrier onto the same run key; what each of them got. One that drives keeps
    the lease until the other has tried, however slow its storage calls are."""
    outcomes: dict[str, str] = {}
    barrier = threading.Barrier(2)
    tried = {name: threading.Event() for name in holders}

    def drive(name: str) -> None:
        (other,) = [holder for holder in holders if holder != name]
        barrier.wait()
        try:
            with run_lease(run_dir, KEY, name, 30):
                outcomes[name] = "drove"
                tried[name].set()
                tried[other].wait(timeout=20)
        except RunLeaseError:
            outcomes[name] = "refused"
        tried[name].set()

    threads = [threading.Thread(target=drive, args=(name,)) for name in holders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(outcomes.values())


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_of_two_drivers_starting_together_exactly_one_proceeds(storage: str, tmp_path: Path, request: Any) -> None:
    """Twelve rounds, holders of different lengths: the old write-wait-read-back lease refused both drivers in
    about a third of such rounds (their simultaneous writes tore the file) and could let both through."""
    if storage == "s3":
        server = request.getfixturevalue("s3_server")
        options = StorageOptions(endpoint_url=server.endpoint_url)
        client = s3_client(options)
        if "prt-lease" not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket="prt-lease")
        root = locate(f"s3://prt-lease/{tmp_path.name}", options)
    else:
        root = locate(str(tmp_path))
    for round_ in range(12):
        run_dir = root.child(f"round-{round_}", KEY)
        assert _race(run_dir, ("a", f"driver-{'b' * round_}")) == ["drove", "refused"], f"round {round_}"
        assert read_lease(run_dir.child(LEASE_FILE)) is None  # the one that drove released it


def test_a_driver_whose_lease_was_taken_stops_renewing_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = locate(str(tmp_path)).child(KEY)
    with run_lease(run_dir, KEY, "holder-a", 1.5):
        _lease_file(tmp_path, "holder-b", expires_in=600)  # taken over (as after an expiry) by another driver
        time.sleep(1.2)  # past a renewal
        lease = read_lease(run_dir.child(LEASE_FILE))
        assert lease is not None and lease.holder == "holder-b"  # holder-a did not write over it
    assert "the lease was taken by holder-b" in caplog.text
    lease = read_lease(run_dir.child(LEASE_FILE))
    assert lease is not None and lease.holder == "holder-b"  # and leaving did not delete b's lease


@pytest.mark.slow
def test_the_holder_keeps_renewing_through_a_storage_outage(tmp_path: Path) -> None:
    """S3 stops answering for longer than a renewal period, then comes back: the driver renews again (a renewer
    that died on the first connection error would leave the lease to expire under a live run), and a storage
    still down when the run ends leaves the lease to expire instead of failing the run."""
    from devtools.s3_server import LocalS3

    server = LocalS3(tmp_path / "s3").start()
    try:
        options = StorageOptions(endpoint_url=server.endpoint_url)
        s3_client(options).create_bucket(Bucket="prt-outage")
        run_dir = locate("s3://prt-outage/runs", options).child(KEY)
        lease_file = run_dir.child(LEASE_FILE)
        with run_lease(run_dir, KEY, "holder-a", 6):  # renewed every 2 s
            server.stop()
            time.sleep(5)  # two renewals fail
            server.start()
            back = time.time()
            time.sleep(5)
            lease = read_lease(lease_file)
            assert lease is not None and lease.holder == "holder-a"
            assert lease.expires_at > back + 6 - 0.5, "the lease was not renewed after storage came back"
            server.stop()  # the run ends while storage is down: the block's outcome stands
        server.start()
        assert read_lease(lease_file) is not None  # left to expire, not deleted
    finally:
        server.stop()


def test_a_run_that_never_started_leaves_no_folder(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), run_lease(locate(str(tmp_path)).child(KEY), KEY, this_driver(), 60):
        raise RuntimeError("pre-flight failed")
    assert not (tmp_path / KEY).exists()


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api", "ray_cluster")
def test_a_second_driver_on_a_running_key_is_refused(tmp_path: Path) -> None:
    """Two processes: the original trains; a manual `--resume` of its key is refused in seconds, trains nothing,
    and the original finishes with every epoch once."""
    import ray
    from mlflow import MlflowClient
    from prefect.settings import PREFECT_API_URL

    from tests.conftest import REPO_ROOT, stop_process_group

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = ["--storage-path", str(tmp_path / "storage"), "--mlflow-tracking-uri", tracking_uri, "--no-register"]
    common += ["--experiment-name", "lease", "--dataset", "synthetic", "--synthetic-samples", "24000"]
    # Both drivers use the session's Ray: the second reaches the lease without starting a Ray of its own, and the
    # first trains long enough (10 epochs) to still hold it by then.
    common += ["--epochs", "10", "--num-workers", "1", "--batch-size", "64"]
    common += ["--ray-address", ray.get_runtime_context().gcs_address]
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        [sys.executable, "-m", "flows.training", *common],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "storage" / "runs").glob("*/epoch-0001")):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.5)
        (run_dir,) = (tmp_path / "storage" / "runs").iterdir()
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "flows.training", *common, "--resume", run_dir.name],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        refused_after = time.monotonic() - started
        assert first.poll() is None, "the first driver finished before the second reached the lease: train longer"
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            stop_process_group(first, signal.SIGKILL)
        log.close()
    output = second.stdout + second.stderr
    assert second.returncode == 1 and "is being driven by" in output, output[-3000:]
    assert "Retry 1/" not in output, output[-3000:]  # refused once: a Prefect retry would only be refused again
    assert re.search(rf"run {run_dir.name} is being driven by \S+:{first.pid}:", output), output[-3000:]
    print(f"\nsecond driver refused {refused_after:.1f} s after it started (whole CLI process)")
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("lease").experiment_id])
    assert run.info.status == "FINISHED"
    assert sorted(int(m.step) for m in client.get_metric_history(run.info.run_id, "val_accuracy")) == list(range(1, 11))
    assert not (run_dir / LEASE_FILE).exists()
