"""Batch scoring: rows per second of the `score` pipeline's actor pool against the same model called in one process.

    python -m bench.scoring [--rows 1000000]

A registered pt2 model (an MLP of 32 inputs, two hidden layers of 256, 4 outputs; no training: weights drawn from a
seed) scores one Parquet table of ``--rows`` rows in 8 files, on a local Ray of 2 CPUs:

- the pipeline: ``raytrain_driver.scoring_run.score`` with 2 actors (Ray Data reads, predicts, stages, commits one
  Parquet file), its plan made beforehand;
- one process: the same model loaded once, the same files read with pyarrow, predicted in batches of the same
  size, written as one Parquet file (torch with its default threads, one per core).

Goal: the pipeline >= 1.5x the one process's rows per second. Two runs each, alternating; medians.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

FEATURES, BATCH, TARGET = 32, 4096, 1.5


def _register(store: str) -> None:
    import mlflow
    import torch
    from mlflow import MlflowClient

    from raytrain_tasks.tracking import runs as tracking
    from raytrain_tasks.tracking.runs import using_tracking_uri

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 4),
    )
    client = MlflowClient(store, registry_uri=store)
    experiment = tracking.ensure_experiment(client, "models", store, "")  # artifacts beside the database
    with using_tracking_uri(store), mlflow.start_run(experiment_id=experiment):
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            input_example=np.zeros((2, FEATURES), np.float32),
            serialization_format="pt2",
            pip_requirements=[],
        )
        version = mlflow.register_model(info.model_uri, "bench").version
    client.set_registered_model_alias("bench", "champion", version)


def _table(folder: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    rng = np.random.default_rng(0)
    per_file = rows // 8
    for index in range(8):
        columns: dict[str, Any] = {"id": np.arange(index * per_file, (index + 1) * per_file)}
        columns |= {f"f{i}": rng.random(per_file, dtype=np.float32) for i in range(FEATURES)}
        pq.write_table(pa.table(columns), folder / f"part-{index}.parquet")


def one_process(store: str, folder: Path, output: Path) -> float:
    """Seconds for the same model, loaded once in this process, over the same files, into one Parquet file."""
    import mlflow.pytorch
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from raytrain_tasks.safe_load import pickle_deserialization_off
    from raytrain_tasks.tracking.runs import using_tracking_uri

    started = time.perf_counter()
    with using_tracking_uri(store), pickle_deserialization_off():
        module = mlflow.pytorch.load_model("models:/bench@champion")
    writer = None
    for path in sorted(folder.glob("*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
            inputs = np.stack([batch.column(f"f{i}").to_numpy() for i in range(FEATURES)], axis=1)
            with torch.no_grad():
                outputs = module(torch.from_numpy(inputs)).numpy()
            table = pa.table({"id": batch.column("id"), "prediction": list(outputs)})
            writer = writer or pq.ParquetWriter(output, table.schema)
            writer.write_table(table)
    if writer is not None:
        writer.close()
    return time.perf_counter() - started


def pipeline(store: str, folder: Path, output: Path, scratch: Path) -> float:
    """Seconds for the scoring pipeline's plan and run (Ray already up)."""
    from raytrain_driver.scoring import plan_scoring
    from raytrain_driver.scoring_run import score
    from raytrain_tasks.scoring.config import ScoringConfig

    config = ScoringConfig(
        model="models:/bench@champion",
        input_path=str(folder),
        output_path=str(output),
        mlflow_tracking_uri=store,
        concurrency=2,
        batch_size=BATCH,
    )
    started = time.perf_counter()
    score(config, plan_scoring(config, scratch))
    return time.perf_counter() - started


def measure(root: Path, rows: int) -> dict[str, Any]:
    store = f"sqlite:///{root / 'mlflow.db'}"
    _register(store)
    _table(root / "table", rows)
    runs: dict[str, list[float]] = {"one_process_s": [], "pipeline_s": []}
    for repeat in range(2):
        runs["one_process_s"].append(one_process(store, root / "table", root / f"one-{repeat}.parquet"))
        runs["pipeline_s"].append(pipeline(store, root / "table", root / f"ray-{repeat}.parquet", root / f"s{repeat}"))
    one, ray_s = statistics.median(runs["one_process_s"]), statistics.median(runs["pipeline_s"])
    return {
        "rows": rows,
        "runs": runs,
        "one_process_rows_per_s": rows / one,
        "pipeline_rows_per_s": rows / ray_s,
        "speedup": one / ray_s,
    }


def main() -> None:
    import ray

    from bench.summary import write_figures
    from raytrain_driver.cluster import worker_env

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    rows = parser.parse_args().rows
    with tempfile.TemporaryDirectory(prefix="prt-bench-score-") as tmp:
        ray.init(address="local", num_cpus=2, runtime_env={"env_vars": worker_env()}, logging_level=logging.ERROR)
        try:
            figures = measure(Path(tmp), rows)
        finally:
            ray.shutdown()
    speedup = figures["speedup"]
    print(f"scoring {rows} rows: one process {figures['one_process_rows_per_s']:.0f} rows/s, pipeline (2 actors)")
    print(f"  {figures['pipeline_rows_per_s']:.0f} rows/s: {speedup:.2f}x (target >= {TARGET}x: ", end="")
    print(f"{'met' if speedup >= TARGET else 'missed'})")
    print(f"written: {write_figures('scoring', figures)}")


if __name__ == "__main__":
    main()
