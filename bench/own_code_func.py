"""The training functions bench/own_code.py times: Ray Train's own shape, reporting the seconds spent inside the
training loop (``loop_seconds``) and, for the sharded one, the seconds its checkpoint took."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raytrain_tasks.api import Metric, TrainFunc

FEATURES, CLASSES = 64, 10


def _data(rows: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, FEATURES, generator=generator)
    y = (x[:, :CLASSES].argmax(1)).to(torch.int64)
    return TensorDataset(x, y)


def _model(hidden: int = 256) -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))  # fmt: skip


def train_func(config: dict[str, Any]) -> None:
    torch.manual_seed(config["seed"])
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(_data(int(config["rows"])), batch_size=int(config["batch_size"]), shuffle=True)
    )
    model = ray.train.torch.prepare_model(_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=float(config["lr"]))
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(int(config["epochs"])):
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        started, total = time.perf_counter(), 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
        loop_seconds = time.perf_counter() - started
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if ray.train.get_context().get_world_rank() == 0:
                torch.save({"model": getattr(model, "module", model).state_dict()}, Path(folder) / "model.pt")
                saved = ray.train.Checkpoint.from_directory(folder)
            metrics = {"epoch": epoch, "loop_seconds": loop_seconds, "train_loss": total / max(1, len(loader))}
            ray.train.report(metrics, checkpoint=saved)


def sharded_func(config: dict[str, Any]) -> None:
    """FSDP2 on a CPU mesh; ``mode``: 'dcp' (every rank saves its shard) or 'full' (rank 0 saves a gathered
    full state dict)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(config["seed"])
    model = _model(int(config["hidden"]))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=float(config["lr"]))
    data = _data(int(config["rows"]))
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=int(config["batch_size"]), sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    previous: dict[str, float] = {}  # epoch N's figures ride on report N+1 (only checkpointed reports reach fit())
    for epoch in range(int(config["epochs"])):
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        saving = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            if config["mode"] == "dcp":
                model_state, optim_state = get_state_dict(model, optimizer)
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
                saved: Any = ray.train.Checkpoint.from_directory(folder)
            else:
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                saved = None
                if rank == 0:
                    torch.save({"model": full}, Path(folder) / "model.pt")
                    saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"epoch": epoch, **previous}, checkpoint=saved)
        ended = time.perf_counter()
        previous = {"epoch_seconds": ended - started, "checkpoint_seconds": ended - saving}


training = TrainFunc(train_func, metric=Metric("train_loss", higher_is_better=False), defaults={"rows": 60_000})
