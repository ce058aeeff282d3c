"""The GPU path for real: NCCL, one GPU per worker, batches on the worker's device. Skipped where no GPU is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from flows.training import training_pipeline
from raytrain_tasks.config import parameters_of
from tests.helpers import small_config

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        GPUS == 0,
        reason="no CUDA GPU on this machine (CI has none); run `pytest -m gpu` where one is",
    ),
]


@pytest.fixture(scope="module")
def gpu_ray() -> object:
    """A local Ray that sees this machine's GPUs (the session's CPU-only fixture does not declare them)."""
    import ray

    from raytrain_driver.cluster import worker_env

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", runtime_env={"env_vars": worker_env()}, logging_level="WARNING")
    yield ray.cluster_resources()
    ray.shutdown()


@pytest.mark.parametrize("loader", ["torch", "ray_data"])
def test_training_on_gpus_uses_nccl_and_reaches_the_cpu_accuracy(
    loader: str, tmp_path: Path, gpu_ray: dict[str, float], prefect_api: None
) -> None:
    workers = min(2, GPUS)
    config = small_config(tmp_path, use_gpu=True, num_workers=workers, data_loader=loader, cpus_per_worker=1.0)
    result = training_pipeline(**parameters_of(config))

    assert result.fit.backend == "nccl"
    assert result.fit.final_metrics["val_accuracy"] >= 0.9
    run = MlflowClient(result.config.mlflow_tracking_uri).get_run(result.fit.mlflow_run_id)
    assert run.data.tags["prefect_raytrain.backend"] == "nccl"
    assert run.data.tags["prefect_raytrain.use_gpu"] == "true"
    # The champion was trained on GPU and loads on CPU (checkpoints hold CPU tensors).
    assert result.model is not None and "champion" in result.model.aliases
    print(
        f"\n{loader} on {workers} x {torch.cuda.get_device_name(0)}: "
        f"{result.fit.final_metrics['samples_per_second']:.0f} samples/s, "
        f"val_accuracy {result.fit.final_metrics['val_accuracy']:.4f}"
    )


# Your own code on GPUs: the examples a user copies, as they are, with use_gpu=True.
OWN_CODE = {
    "seed_ddp": ("examples.seed_ddp.train:training", '{"hidden": 32}', "val_accuracy", 0.9, (2, 64)),
    "image_classifier": (
        "examples.image_classifier.train:training",
        '{"channels": 8}',
        "val_accuracy",
        0.8,
        (2, 1, 8, 8),
    ),
}


@pytest.mark.parametrize("example", list(OWN_CODE))
def test_your_own_code_trains_on_gpus_over_nccl_and_its_champion_loads_where_no_gpu_is(
    example: str, tmp_path: Path, gpu_ray: dict[str, float], prefect_api: None
) -> None:
    """A train_func (level b) and a TrainSpec (level a) copied from examples/, trained with NCCL on the GPU: the
    metrics the example reduces across workers must be on the device NCCL reduces (a CPU tensor fails there), and
    the checkpoint a GPU worker wrote must load through the example's own code on a machine without CUDA (a CPU
    registry host or server)."""
    import os
    import subprocess
    import sys

    code, train_config, metric, floor, shape = OWN_CODE[example]
    config = small_config(
        tmp_path,
        train_code=code,
        train_config=train_config,
        use_gpu=True,
        num_workers=min(2, GPUS),
        cpus_per_worker=1.0,
        epochs=4,
        register=True,
    )
    result = training_pipeline(**parameters_of(config))

    assert result.fit.backend == "nccl"
    assert result.fit.best_metrics[metric] >= floor, result.fit.best_metrics
    assert result.model is not None and "champion" in result.model.aliases
    run = MlflowClient(result.config.mlflow_tracking_uri).get_run(result.fit.mlflow_run_id)
    assert run.data.tags["prefect_raytrain.backend"] == "nccl"
    # The registered champion, loaded and run in a process that sees no GPU.
    script = (
        "import mlflow, numpy as np, torch; assert not torch.cuda.is_available();"
        f"mlflow.set_tracking_uri({result.config.mlflow_tracking_uri!r});"
        f"m = mlflow.pyfunc.load_model('models:/{config.model_name}@champion');"
        f"print('predicted', np.asarray(m.predict(np.zeros({shape}, np.float32))).shape)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    print(f"\n{example} on {config.num_workers} x {torch.cuda.get_device_name(0)}: {result.fit.best_metrics}")


def test_scoring_on_gpus_predicts_what_the_model_predicts_on_the_cpu(
    gpu_ray: object, tmp_path: Path, prefect_api: None
) -> None:
    """`score` with use_gpu: each actor holds the model on a GPU; the predictions equal the CPU's (to 1e-4)."""
    import numpy as np
    import pandas as pd

    from flows.scoring import scoring_pipeline
    from tests.helpers import seed_mlflow_store
    from tests.registered_versions import register_pt2

    store = f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}"
    register_pt2(store, "on-gpu", width=4, outputs=1)
    table = pd.DataFrame({"id": np.arange(5000), **{n: np.random.default_rng(0).random(5000) for n in "abcd"}})
    table.to_parquet(tmp_path / "in.parquet")
    given = {
        "model": "models:/on-gpu@champion",
        "input_path": str(tmp_path / "in.parquet"),
        "mlflow_tracking_uri": store,
    }
    on_gpu = scoring_pipeline(**given, output_path=str(tmp_path / "gpu.parquet"), use_gpu=True, concurrency=1)
    on_cpu = scoring_pipeline(**given, output_path=str(tmp_path / "cpu.parquet"), concurrency=1)
    assert on_gpu.rows == on_cpu.rows == 5000
    gpu = pd.read_parquet(tmp_path / "gpu.parquet").sort_values("id")["prediction"].to_numpy()
    cpu = pd.read_parquet(tmp_path / "cpu.parquet").sort_values("id")["prediction"].to_numpy()
    assert np.allclose(gpu, cpu, atol=1e-4)
