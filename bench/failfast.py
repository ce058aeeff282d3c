"""Bad input: seconds from calling the flow to its clear error, and how many Ray Train actors it started.

    python -m bench.failfast

Runs the real flow (local Ray, temporary Prefect API, MLflow on SQLite) with one wrong setting at a time. The
tests assert what a user cares about (the error names the setting; nothing was started or written); this prints
how long the user waits for it. For scale: Ray Train left to find out by itself that a worker group cannot be
placed waits RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s here) per attempt.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.summary import write_figures


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="prt-bench-") as tmp:
        workdir = Path(tmp)
        # Before Prefect is imported: its settings (and the home folder it creates) are read at import.
        os.environ["PREFECT_HOME"] = str(workdir / "prefect")

        import ray
        from prefect.testing.utilities import prefect_test_harness
        from ray.util.state import list_actors

        from flows.training import training_pipeline
        from raytrain_driver.cluster import worker_env
        from raytrain_tasks.config import TrainingConfig, parameters_of

        def train_actors() -> set[str]:
            address = ray.get_runtime_context().gcs_address
            return {
                actor.actor_id
                for name in ("TrainController", "RayTrainWorker")
                for actor in list_actors(address=address, filters=[("class_name", "=", name)], limit=10_000)
            }

        cases: dict[str, dict[str, Any]] = {
            "use_gpu=True, no GPU in the cluster": {"use_gpu": True},
            "num_workers=8 on 2 CPUs": {"num_workers": 8},
            "mlflow_tracking_uri: nothing listening": {"mlflow_tracking_uri": f"http://127.0.0.1:{_closed_port()}"},
            "ray_address: nothing listening": {"ray_address": f"127.0.0.1:{_closed_port()}"},
            "s3_endpoint_url: nothing listening": {
                "storage_path": "s3://prt-bench/storage",
                "s3_endpoint_url": f"http://127.0.0.1:{_closed_port()}",
            },
        }
        rows: list[tuple[str, float, int | None, str]] = []
        with prefect_test_harness(server_startup_timeout=120):
            for number, (case, overrides) in enumerate(cases.items()):
                # The unreachable cluster runs while this process is connected to no Ray (else the flow reports
                # that connection instead); there is no cluster on which to count its actors.
                if ray.is_initialized() == ("ray_address" in overrides):
                    if ray.is_initialized():
                        ray.shutdown()
                    else:
                        ray.init(
                            address="local",
                            num_cpus=2,
                            runtime_env={"env_vars": worker_env()},
                            logging_level=logging.ERROR,
                        )
                case_dir = workdir / f"case-{number}"
                values: dict[str, Any] = {
                    "train_config": {"dataset": "synthetic"},
                    "storage_path": str(case_dir / "storage"),
                    "mlflow_tracking_uri": f"sqlite:///{case_dir / 'mlflow.db'}",
                    "retry_delay_seconds": 0,
                }
                config = TrainingConfig(**(values | overrides))
                before = train_actors() if ray.is_initialized() else None
                started = time.monotonic()
                state = training_pipeline(**parameters_of(config), return_state=True)
                seconds = time.monotonic() - started
                error = state.result(raise_on_failure=False)
                named = type(error).__name__ if state.is_failed() else "no error (the run did not fail)"
                if state.is_failed() and "ray_address" in overrides and "already connected" in str(error):
                    raise SystemExit(f"the {case!r} case met a connected Ray instead: {error}")
                actors = None if before is None else len(train_actors() - before)
                rows.append((case, seconds, actors, named))
        if ray.is_initialized():
            ray.shutdown()
        print("\n| wrong setting | flow call -> error (s) | Ray Train actors started | error |")
        print("|---|---:|---:|---|")
        for case, seconds, actors, named in rows:
            print(f"| {case} | {seconds:.1f} | {'-' if actors is None else actors} | {named} |")
        figures = [{"case": c, "seconds": t, "actors": a, "error": e} for c, t, a, e in rows]
        print(f"written: {write_figures('failfast', {'cases': figures})}")


if __name__ == "__main__":
    main()
