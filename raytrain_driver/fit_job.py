"""The entrypoint of a fit's Ray Job (launch_mode=ray_job; see raytrain_driver/ray_job.py), run by Ray on the cluster.

    python -m raytrain_driver.fit_job '<json: config, dataset, run_key, origin>'

It is the same fit as a driver run, with this process as the driver: it takes the run's lease, trains with
Ray Train, logs to MLflow and writes the run's fit record, which the submitting task reads. A SIGTERM (Ray's
``stop_job``) marks the MLflow run KILLED and keeps the checkpoints. On failure its last line names the error
(raytrain_driver.ray_job.ERROR_MARKER) so that the task raises the same kind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import traceback
from typing import Any

from pydantic import TypeAdapter

from raytrain_driver.ray_job import ERROR_MARKER
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.environment import apply_process_defaults
from raytrain_tasks.prepared import RunData
from raytrain_tasks.redact import install_log_redaction, redact


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    apply_process_defaults()  # before Ray and MLflow read theirs
    import ray

    from raytrain_driver.cluster import init_within
    from raytrain_driver.fit import fit_in_this_process
    from raytrain_tasks.storage.locations import RUNS_DIR, locate

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    install_log_redaction("prefect_raytrain", "ray", "mlflow")
    payload = json.loads(argv[0])
    config = TrainingConfig.model_validate(payload["config"])
    # A job's driver joins its own cluster (Ray sets RAY_ADDRESS), and its tasks and actors get the job's
    # runtime_env: the code and environment the submitter chose (raytrain_driver/ray_job.py). ray_session then finds Ray
    # connected and leaves it so.
    address = os.environ.get("RAY_ADDRESS", "auto")
    init_within(config.ray_connect_timeout_s, address=address, logging_level=logging.WARNING)
    config = config.model_copy(update={"ray_address": ray.get_runtime_context().gcs_address})
    signal.signal(signal.SIGTERM, _interrupt)  # stop_job: end like a cancelled driver (MLflow KILLED)
    dataset = TypeAdapter(RunData | None).validate_python(payload["dataset"])
    run_key = str(payload["run_key"])
    runs = locate(config.storage_path, config.storage_options).child(RUNS_DIR)
    try:
        fit = fit_in_this_process(config, dataset, run_key, runs, origin=payload["origin"])
    except BaseException as exc:  # noqa: BLE001 - reported to the submitting task by name, then the job fails
        print(redact(traceback.format_exc()), flush=True)
        print(f"{ERROR_MARKER}{json.dumps({'type': type(exc).__name__, 'message': redact(str(exc))})}", flush=True)
        return 1
    print(f"fit of run {run_key} done: best epoch {fit.best_epoch}, record in {fit.run_uri}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
