"""Ray Train's own training function fed by Ray Data, in the shape of the seeds' ``train_ray_ddp_with_ray_data.py``:
the datasets are built once on the driver and handed to ``TorchTrainer(datasets=...)``; each worker reads its shard
with ``ray.train.get_dataset_shard("train")`` and ``iter_torch_batches``; one ``ray.train.report`` per epoch with a
checkpoint from rank 0, and a resume from ``ray.train.get_checkpoint()``. Nothing here imports Prefect or MLflow.

Run it through the pipeline from the folder that holds ``examples/``::

    prefect-raytrain train --train-code examples.seed_ray_data.train:training

To bring your own: copy this package, change ``build_model`` and ``datasets`` (``ray.data.read_parquet``,
``read_images``, ``read_csv``... on a path every node can read); keep the report and the checkpoint as they are.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray.data
import ray.train
import ray.train.torch
import torch
from torch import nn

from raytrain_tasks.api import Metric, TrainFunc

CHECKPOINT_FILE = "checkpoint.pt"
FEATURES = 10


def build_model(config: dict[str, Any]) -> nn.Module:
    """Your model, from the config (``train_config`` keys are in it)."""
    return nn.Sequential(nn.Linear(FEATURES, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 1))


def datasets(config: dict[str, Any]) -> dict[str, ray.data.Dataset]:
    """Your data as Ray Datasets, built on the driver: here scikit-learn's bundled diabetes table (no download),
    standardised, 80/20. Ray Train splits every dataset across the workers: each reads its share of both."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = ((x - x.mean(0)) / x.std(0))[order].astype(np.float32)
    y = ((y - y.mean()) / y.std())[order].astype(np.float32)
    cut = int(0.8 * len(y))
    rows = [{"features": features, "target": target} for features, target in zip(x, y, strict=True)]
    return {"train": ray.data.from_items(rows[:cut]), "validation": ray.data.from_items(rows[cut:])}


def train_func(config: dict[str, Any]) -> None:
    torch.manual_seed(config["seed"])
    model = ray.train.torch.prepare_model(build_model(config))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = nn.MSELoss()

    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        getattr(model, "module", model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1

    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("validation")
    for epoch in range(start, config["epochs"]):
        model.train()
        for batch in train_shard.iter_torch_batches(batch_size=config["batch_size"]):
            optimizer.zero_grad()
            loss = loss_fn(model(batch["features"]).squeeze(1), batch["target"])
            loss.backward()
            optimizer.step()
        model.eval()
        squared, count = 0.0, 0
        with torch.no_grad():
            for batch in val_shard.iter_torch_batches(batch_size=256):
                squared += float(((model(batch["features"]).squeeze(1) - batch["target"]) ** 2).sum())
                count += len(batch["target"])
        sums = torch.tensor(
            [squared, count], dtype=torch.float64, device=ray.train.torch.get_device()
        )  # NCCL: on the GPU
        if torch.distributed.is_initialized():  # each worker read its own share of "validation"
            torch.distributed.all_reduce(sums)
        metrics = {"epoch": epoch, "val_rmse": float(sums[0] / sums[1]) ** 0.5}

        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if ray.train.get_context().get_world_rank() == 0:
                state = {
                    "model": getattr(model, "module", model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                }
                torch.save(state, os.path.join(folder, CHECKPOINT_FILE))
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=saved)


def load_model(checkpoint_dir: Path, config: dict[str, Any]) -> nn.Module:
    """The servable model from one of train_func's checkpoints (read with weights_only: no pickled code)."""
    model = build_model(config)
    model.load_state_dict(torch.load(checkpoint_dir / CHECKPOINT_FILE, map_location="cpu", weights_only=True)["model"])
    return model


training = TrainFunc(
    train_func,
    metric=Metric("val_rmse", higher_is_better=False),
    load_model=load_model,
    input_example=lambda config: torch.zeros(2, FEATURES),
    datasets=datasets,
    defaults={"hidden": 32},
)
