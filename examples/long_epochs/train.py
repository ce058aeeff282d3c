"""Ray Train's own training function with checkpoints within an epoch, for epochs that take hours.

Every ``save_every_steps`` steps, each rank writes where it is in its data (``loader-rank<R>.json``) beside rank 0's
model and optimizer, and reports that checkpoint. A resume reads its rank's position and starts the epoch there,
so a worker killed in the middle of an epoch costs at most ``save_every_steps`` steps, not the epoch. A worker told
to go first (a SIGTERM, a node drain) costs no step: ``checkpoint_if_preempted`` has every rank save at once.

The pipeline records such a checkpoint like any other (pinned by digest, resumed from, kept until a newer one
pushes it out) once its report says what it is:

- ``in_epoch``: the epoch in progress (counted from 0), instead of ``epoch``, which names a finished epoch;
- ``global_step``: the steps trained so far, the x-axis of the ``steps/train_loss`` chart in MLflow;
- the metric (``val_accuracy``) as NaN: no epoch has been scored, so it ranks last and is never registered.

Run it from the folder that holds ``examples/``::

    prefect-raytrain train --train-code examples.long_epochs.train:training --train-config '{"save_every_steps": 20}'
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raytrain_tasks.api import Metric, TrainFunc, checkpoint_if_preempted

MODEL_FILE = "model.pt"


class PositionedSampler(DistributedSampler):  # type: ignore[type-arg]
    """This rank's share of an epoch, in an order of the seed and the epoch alone, able to start after its first
    ``rows``. Being a DistributedSampler, ``prepare_data_loader`` keeps it."""

    def __init__(self, dataset: Any, seed: int) -> None:
        context = ray.train.get_context()
        super().__init__(
            dataset, num_replicas=context.get_world_size(), rank=context.get_world_rank(), shuffle=True, seed=seed
        )
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0  # the resumed epoch only
        return itertools.islice(super().__iter__(), skip, None)


def build_model(config: dict[str, Any]) -> nn.Module:
    return nn.Sequential(nn.Linear(64, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 10))


def load_splits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's bundled 8x8 digits (no download), 80/20, the same split on every worker."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.int64)
    cut = int(0.8 * len(y))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def train_func(config: dict[str, Any]) -> None:
    torch.manual_seed(config["seed"])
    rank = ray.train.get_context().get_world_rank()
    train_set, val_set = load_splits()
    sampler = PositionedSampler(train_set, config["seed"])
    train_loader = ray.train.torch.prepare_data_loader(
        DataLoader(train_set, batch_size=config["batch_size"], sampler=sampler)
    )
    val_loader = ray.train.torch.prepare_data_loader(DataLoader(val_set, batch_size=256))
    model = ray.train.torch.prepare_model(build_model(config))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = nn.CrossEntropyLoss()

    start, step, global_step = 0, 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / MODEL_FILE, map_location="cpu", weights_only=True)
            position = json.loads((Path(folder) / f"loader-rank{rank}.json").read_text())
        getattr(model, "module", model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, step, global_step = position["epoch"], position["step"], position["global_step"]
        sampler.skip = step * config["batch_size"]

    for epoch in range(start, config["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            step, global_step = step + 1, global_step + 1
            if step < len(train_loader):  # at the epoch's last step, the epoch's own checkpoint follows at once
                position = {"epoch": epoch, "step": step, "global_step": global_step}
                metrics = {"in_epoch": epoch, "global_step": global_step, "step_train_loss": loss.item()}
                save = functools.partial(
                    _report, {**metrics, "val_accuracy": math.nan}, model, optimizer, position, rank
                )
                # A SIGTERM to a worker or a node drain: every rank saves here first.
                if not checkpoint_if_preempted(save) and step % config["save_every_steps"] == 0:
                    save()
        step = 0
        metrics = {"epoch": epoch, "global_step": global_step, "train_loss": loss.item()}
        metrics |= _validate(model, val_loader, loss_fn)
        _report(metrics, model, optimizer, {"epoch": epoch + 1, "step": 0, "global_step": global_step}, rank)


def _validate(model: nn.Module, val_loader: Any, loss_fn: Any) -> dict[str, float]:
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=ray.train.torch.get_device())
    with torch.no_grad():
        for x, y in val_loader:
            logits = model(x)
            sums += torch.tensor([loss_fn(logits, y).item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    return {"val_loss": float(sums[0] / sums[2]), "val_accuracy": float(sums[1] / sums[2])}


def _report(metrics: dict[str, Any], model: nn.Module, optimizer: Any, position: dict[str, int], rank: int) -> None:
    """Every rank writes its position; rank 0 also the model. Ray Train gathers the files in one checkpoint."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / f"loader-rank{rank}.json").write_text(json.dumps(position))
        if rank == 0:
            state = {"model": getattr(model, "module", model).state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, Path(folder) / MODEL_FILE)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def load_model(checkpoint_dir: Path, config: dict[str, Any]) -> nn.Module:
    model = build_model(config)
    model.load_state_dict(torch.load(checkpoint_dir / MODEL_FILE, map_location="cpu", weights_only=True)["model"])
    return model


training = TrainFunc(
    train_func,
    metric=Metric("val_accuracy", higher_is_better=True),
    load_model=load_model,
    input_example=lambda config: torch.zeros(2, 64),
    defaults={"hidden": 32, "save_every_steps": 20},
)
