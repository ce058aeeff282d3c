"""A model too big for one device, the way Ray's FSDP2 guide trains it: ``fully_shard`` per layer on a device
mesh, and a checkpoint written by **every rank** with ``torch.distributed.checkpoint`` (DCP): each rank saves its
shard (``__<rank>_0.distcp``), rank 0 also the ``.metadata``, and every rank reports its folder. Ray Train merges
the ranks' files into one checkpoint; the pipeline records a digest over all of them, resumes only from a
checkpoint whose files all verify, and registers one model made from the shards by ``load_model``.

On CPU (gloo) here; on GPUs use ``init_device_mesh("cuda", ...)``. Ray's ``prepare_model(parallel_strategy=
"fsdp")`` is FSDP1 and needs CUDA, so this calls ``fully_shard`` itself.

    prefect-raytrain train --train-code examples.fsdp_sharded.train:training --epochs 4
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raytrain_tasks.api import Metric, TrainFunc

FEATURES, CLASSES = 64, 10
EPOCH_FILE = "epoch.json"


def build_model(config: dict[str, Any]) -> nn.Sequential:
    hidden = int(config["hidden"])
    return nn.Sequential(
        nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)
    )


def load_splits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.int64)
    cut = int(0.8 * len(y))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def shard(model: nn.Sequential, world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_func(config: dict[str, Any]) -> None:
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(config["seed"])
    model = shard(build_model(config), world)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    train_set, val_set = load_splits()
    sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, num_replicas=world, rank=rank, shuffle=True, seed=config["seed"]
    )
    loader = DataLoader(train_set, batch_size=config["batch_size"], sampler=sampler)

    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # every rank loads its own shard from the merged folder
        with checkpoint.as_directory() as folder:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)  # in place, per rank
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
            start = json.loads((Path(folder) / EPOCH_FILE).read_text())["epoch"] + 1

    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(start, config["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        model.eval()
        mine = range(rank, len(val_set), world)  # disjoint slices: exact sums over the split
        with torch.no_grad():
            x, y = val_set[list(mine)]
            logits = model(x)
            sums = torch.tensor(
                [float(loss_fn(logits, y)) * len(y), float((logits.argmax(1) == y).sum()), len(y)],
                dtype=torch.float64,
                device=ray.train.torch.get_device(),  # NCCL reduces tensors on the GPU only
            )
        torch.distributed.all_reduce(sums)
        metrics = {"epoch": epoch, "val_loss": float(sums[0] / sums[2]), "val_accuracy": float(sums[1] / sums[2])}

        with tempfile.TemporaryDirectory() as folder:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)  # every rank its shard
            if rank == 0:
                (Path(folder) / EPOCH_FILE).write_text(json.dumps({"epoch": epoch}))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def load_model(checkpoint_dir: Path, config: dict[str, Any]) -> nn.Module:
    """One model from the shards: DCP's own converter writes a full state dict (the pipeline has verified every
    file of the folder first: reading DCP metadata unpickles)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full.pt"
        dcp_to_torch_save(checkpoint_dir, full)
        state = torch.load(full, map_location="cpu", weights_only=False)["model"]
    model = build_model(config)
    model.load_state_dict(state)
    return model


training = TrainFunc(
    train_func,
    metric=Metric("val_accuracy", higher_is_better=True),
    load_model=load_model,
    input_example=lambda config: torch.zeros(2, FEATURES),
    defaults={"hidden": 64},
)
