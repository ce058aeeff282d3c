"""Recovery after a worker kill: seconds from SIGKILL to the first resumed training step, epochs lost.

    python -m bench.recovery

Runs the real flow (local Ray, temporary Prefect API, MLflow on SQLite) on a synthetic job, kills one Ray
Train worker right after epoch 1 is committed, and derives when the resumed epoch started from MLflow:
the epoch's commit time minus its own duration.
"""

from __future__ import annotations

import contextvars
import logging
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="prt-bench-") as tmp:
        workdir = Path(tmp)
        # Before Prefect is imported: its settings (and the home folder it creates) are read at import.
        os.environ["PREFECT_HOME"] = str(workdir / "prefect")

        import ray
        from mlflow import MlflowClient
        from prefect.testing.utilities import prefect_test_harness
        from ray.util.state import list_actors

        from flows.training import training_pipeline
        from raytrain_tasks.config import TrainingConfig
        from tasks.cluster import worker_env

        tracking = f"sqlite:///{workdir / 'mlflow.db'}"
        config = TrainingConfig(
            dataset="synthetic",
            synthetic_samples=24_000,
            epochs=4,
            batch_size=64,
            storage_path=str(workdir / "storage"),
            mlflow_tracking_uri=tracking,
            register=False,
        )
        ray.init(address="local", num_cpus=2, runtime_env={"env_vars": worker_env()}, logging_level=logging.ERROR)
        with prefect_test_harness(server_startup_timeout=120), ThreadPoolExecutor(1) as pool:
            future = pool.submit(contextvars.copy_context().run, training_pipeline, config=config)
            client = MlflowClient(tracking)

            def committed() -> set[int]:
                experiment = client.get_experiment_by_name(config.experiment_name)
                runs = client.search_runs([experiment.experiment_id]) if experiment else []
                if not runs:
                    return set()
                return {m.step for m in client.get_metric_history(runs[0].info.run_id, "val_accuracy")}

            while 1 not in committed():
                time.sleep(0.1)
            # The address of the Ray started above: without it the State API follows
            # /tmp/ray/ray_current_cluster, which an earlier `ray start` cluster may have left stale.
            workers = list_actors(
                address=ray.get_runtime_context().gcs_address,
                filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
            )
            killed_at = time.time()
            pid = workers[-1].pid
            if pid is None:
                raise SystemExit("the State API reported a training worker without a pid")
            os.kill(int(pid), signal.SIGKILL)
            result = future.result(timeout=900)
        ray.shutdown()
        history = {int(e["epoch"]): e for e in result.fit.history}
        run = client.get_run(result.fit.mlflow_run_id)
        times = {m.step: m.timestamp / 1000 for m in client.get_metric_history(run.info.run_id, "val_accuracy")}
        resumed_started = times[2] - history[2]["epoch_seconds"]
        print(f"epoch time (uninterrupted epochs): {history[1]['epoch_seconds']:.2f} s")
        print(f"kill -> first resumed training step: {resumed_started - killed_at:.1f} s")
        print(f"kill -> epoch 2 committed: {times[2] - killed_at:.1f} s")
        print("epochs of work lost: the part of epoch 2 done before the kill (under 1 epoch); epochs 0-1 kept")


if __name__ == "__main__":
    main()
