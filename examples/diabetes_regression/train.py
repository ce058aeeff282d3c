"""A regression trained with Ray Train's own train_func: RMSE on scikit-learn's bundled diabetes table (no
download), lower is better, so the promotion gate moves ``champion`` only to a version with a lower RMSE.

    prefect-raytrain train --train-code examples.diabetes_regression.train:training --epochs 20

To bring your own table: change ``load_splits`` (any features, one numeric target) and ``build_model``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raytrain_tasks.api import Metric, TrainFunc

CHECKPOINT_FILE = "checkpoint.pt"
FEATURES = 10


def build_model(config: dict[str, Any]) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 1))


def load_splits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's diabetes table (442 rows, 10 standardised features); the target scaled to unit spread."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = torch.tensor(x[order] * 20.0, dtype=torch.float32)  # the bundled features are scaled to a tiny norm
    y = torch.tensor((y[order] - y.mean()) / y.std(), dtype=torch.float32).unsqueeze(1)
    cut = int(0.8 * len(y))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def train_func(config: dict[str, Any]) -> None:
    torch.manual_seed(config["seed"])
    train_set, val_set = load_splits()
    train_loader = ray.train.torch.prepare_data_loader(
        DataLoader(train_set, batch_size=config["batch_size"], shuffle=True)
    )
    val_loader = ray.train.torch.prepare_data_loader(DataLoader(val_set, batch_size=512))
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
        torch.set_rng_state(state["rng"])
        start = state["epoch"] + 1

    for epoch in range(start, config["epochs"]):
        sampler = getattr(train_loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        model.eval()
        squared, count = 0.0, 0
        with torch.no_grad():
            for x, y in val_loader:
                squared += float(((model(x) - y) ** 2).sum())
                count += len(y)
        sums = torch.tensor(
            [squared, count], dtype=torch.float64, device=ray.train.torch.get_device()
        )  # NCCL: on the GPU
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        metrics = {"epoch": epoch, "val_rmse": float((sums[0] / sums[1]).sqrt())}
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if ray.train.get_context().get_world_rank() == 0:
                state = {
                    "model": getattr(model, "module", model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "rng": torch.get_rng_state(),
                    "epoch": epoch,
                }
                torch.save(state, os.path.join(folder, CHECKPOINT_FILE))
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=saved)


def load_model(checkpoint_dir: Path, config: dict[str, Any]) -> nn.Module:
    model = build_model(config)
    model.load_state_dict(torch.load(checkpoint_dir / CHECKPOINT_FILE, map_location="cpu", weights_only=True)["model"])
    return model


training = TrainFunc(
    train_func,
    metric=Metric("val_rmse", higher_is_better=False),
    load_model=load_model,
    input_example=lambda config: torch.zeros(2, FEATURES),
    defaults={"hidden": 32},
)
