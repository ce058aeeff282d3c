"""Ray Train's own training function, in the shape of the seeds' ``train_ray_ddp.py``: a model, a torch
DataLoader, ``prepare_model``/``prepare_data_loader``, one ``ray.train.report`` per epoch with a checkpoint from
rank 0, and a resume from ``ray.train.get_checkpoint()``. Nothing here imports Prefect or MLflow.

Run it through the pipeline from the folder that holds ``examples/``::

    prefect-raytrain train --train-code examples.seed_ddp.train:training --train-config '{"hidden": 64}'

To bring your own: copy this package, change ``build_model`` and ``load_splits``; keep the report and the
checkpoint as they are.
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


def build_model(config: dict[str, Any]) -> nn.Module:
    """Your model, from the config (``train_config`` keys are in it)."""
    return nn.Sequential(nn.Linear(64, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 10))


def load_splits() -> tuple[TensorDataset, TensorDataset]:
    """Your data: here scikit-learn's bundled 8x8 digits (no download), 80/20, the same split on every worker."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.int64)
    cut = int(0.8 * len(y))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def train_func(config: dict[str, Any]) -> None:
    torch.manual_seed(config["seed"])
    train_set, val_set = load_splits()
    train_loader = ray.train.torch.prepare_data_loader(
        DataLoader(train_set, batch_size=config["batch_size"], shuffle=True)
    )
    val_loader = ray.train.torch.prepare_data_loader(DataLoader(val_set, batch_size=256))
    model = ray.train.torch.prepare_model(build_model(config))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = nn.CrossEntropyLoss()

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
        if isinstance(sampler, DistributedSampler):  # each epoch its own shuffle, the same on a resume
            sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        model.eval()
        correct, total, val_loss = 0, 0, 0.0
        with torch.no_grad():
            for x, y in val_loader:
                logits = model(x)
                val_loss += loss_fn(logits, y).item() * len(y)
                correct += (logits.argmax(1) == y).sum().item()
                total += len(y)
        sums = torch.tensor(
            [val_loss, correct, total], dtype=torch.float64, device=ray.train.torch.get_device()
        )  # NCCL: on the GPU
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        metrics = {"epoch": epoch, "val_loss": float(sums[0] / sums[2]), "val_accuracy": float(sums[1] / sums[2])}

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
    """The servable model from one of train_func's checkpoints (read with weights_only: no pickled code)."""
    model = build_model(config)
    model.load_state_dict(torch.load(checkpoint_dir / CHECKPOINT_FILE, map_location="cpu", weights_only=True)["model"])
    return model


training = TrainFunc(
    train_func,
    metric=Metric("val_accuracy", higher_is_better=True),
    load_model=load_model,
    input_example=lambda config: torch.zeros(2, 64),
    defaults={"hidden": 32},
)
