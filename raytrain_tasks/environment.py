"""The process environment defaults of the pipeline, declared once: ``PROCESS_DEFAULTS`` applied at each entry point
(the flow package, imported by the command, a deployment and a Prefect worker alike; a fit's Ray Job; the
benchmarks; the test suite), ``MLFLOW_CLIENT_DEFAULTS`` where the driver opens its MLflow client.

Each applies only where the user has not set the variable: a value in the environment always wins.
"""

from __future__ import annotations

import os
from pathlib import Path

PROCESS_DEFAULTS: dict[str, str] = {
    # The temporary API server a flow starts without PREFECT_API_URL needs ~10 s for its first migrations on small
    # machines; Prefect's 20 s default start timeout is too tight there.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # Offline machines otherwise log failed telemetry calls.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray Data 2.60 starts this many actors to read Parquet footers for every `ray.data.read_parquet` (default
    # 32): on a small Ray they outnumber the CPUs and can stall the read (ray#65406); Ray's own tests pin 1
    # (ray#65169). Measured here on 2 CPUs, a first read of 4 files: 3.1 s and 5.9 CPU-s with 32, 2.1 s and
    # 3.5 CPU-s with 1. Raise it on a cluster that reads thousands of files.
    "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1",
}

# The driver's MLflow client: a dead server costs seconds, not MLflow's default minutes of retries per request.
# Applied when the driver opens its client (raytrain_tasks.tracking.runs.connect), not at an entry point: a Ray
# started before that (a served deployment's warm Ray, the suite's) must not inherit them, so that the Ray Train
# controller keeps its own, shorter ones (raytrain_tasks.tracking.controller.CONTROLLER_HTTP_ENV).
MLFLOW_CLIENT_DEFAULTS: dict[str, str] = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def apply_process_defaults() -> None:
    """Set each of ``PROCESS_DEFAULTS`` the environment does not set, and create a missing ``PREFECT_HOME`` (Prefect
    does not create missing parents of it, e.g. ``.pipeline/prefect`` on a fresh checkout, and then fails to open its
    database). Call it before Prefect, Ray or MLflow read their settings."""
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if os.environ.get("PREFECT_HOME"):
        Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)


# What says Prefect is set up here: then its home, profile and API are the user's, used as they are.
PREFECT_CONFIGURED_BY = ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_PROFILES_PATH", "PREFECT_PROFILE")


def embedded_prefect_home(state_dir: str) -> None:
    """The command's embedded defaults: Prefect's state (the temporary API's database, the pin journals) goes to
    ``<state_dir>/prefect`` in the folder the command runs in, beside MLflow's store and the checkpoints, as
    `make run` keeps it (a newcomer following docs/own-model.md found 5 MB in ~/.prefect). Unless Prefect is set up
    here: one of ``PREFECT_CONFIGURED_BY`` in the environment, a profiles file in ~/.prefect (`prefect profile`,
    `prefect config set`), or settings Prefect reads from this folder (``prefect.toml``, ``PREFECT_`` lines in
    ``.env``, ``[tool.prefect]`` in ``pyproject.toml``): Prefect then does as it would. Call it before Prefect
    reads its settings; not at an import that a deployment's worker makes."""
    if any(os.environ.get(name) for name in PREFECT_CONFIGURED_BY):
        return
    if (Path.home() / ".prefect" / "profiles.toml").exists() or Path("prefect.toml").exists():
        return
    for file, mark in ((".env", "PREFECT_"), ("pyproject.toml", "[tool.prefect")):
        try:
            if mark in Path(file).read_text(errors="replace"):
                return
        except OSError:  # absent (or unreadable, as Prefect would find it too)
            continue
    home = Path(state_dir, "prefect").resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["PREFECT_HOME"] = str(home)


def apply_mlflow_client_defaults() -> None:
    """Set each of ``MLFLOW_CLIENT_DEFAULTS`` the environment does not set."""
    for name, value in MLFLOW_CLIENT_DEFAULTS.items():
        os.environ.setdefault(name, value)
