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
