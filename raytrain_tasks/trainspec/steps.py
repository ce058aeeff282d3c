"""The steps of a ``TrainSpec``'s loop (``loop``) over batches of either kind: one epoch's training, and the loss and
metrics of a split, exact over the whole split (each rank scores its batches, the sums are all-reduced on the device:
NCCL reduces no CPU tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from raytrain_tasks.api import TrainSpec


def train_epoch(
    spec: TrainSpec,
    model: Any,
    optimizer: Any,
    batches: Any,
    after_step: Callable[[torch.Tensor, int], None] | None = None,
    start: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, int]:
    """One epoch's training steps: (the sum of the batches' losses weighted by their rows, rows), counted on from
    ``start`` (an epoch resumed part-way). ``after_step`` is called with the sums so far after every step."""
    import ray.train.torch  # here, not at import: the CLI's check of the code imports this module before Ray starts

    device = ray.train.torch.get_device()
    total, count = start if start is not None else (torch.zeros((), dtype=torch.float64), 0)
    for batch_inputs, batch_targets in batches:
        inputs, targets = batch_inputs.to(device), batch_targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = spec.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        total += loss.detach().to(torch.float64).cpu() * len(targets)
        count += len(targets)
        if after_step is not None:
            after_step(total, count)
    return total, count


def batch_sums(spec: TrainSpec, model: Any, batches: Any, device: Any) -> tuple[dict[str, float], int]:
    """({"loss": sum, <metric>: sum, ...}, rows) over ``batches``, each batch's means weighted by its rows."""
    sums: dict[str, float] = {}
    count = 0
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        outputs = model(inputs)
        batch = {"loss": spec.loss(outputs, targets)}
        if spec.metrics is not None:
            batch |= dict(spec.metrics(outputs, targets))
        for key, value in batch.items():
            sums[key] = sums.get(key, 0.0) + float(value) * len(targets)
        count += len(targets)
    return sums, count


def score_split(spec: TrainSpec, model: Any, batches: Any, split: str) -> dict[str, float]:
    """Loss and metrics over the whole split: this rank scores its batches, the sums are all-reduced."""
    import ray.train.torch  # here, not at import: the CLI's check of the code imports this module before Ray starts

    model.eval()
    net = getattr(model, "module", model)  # not DDP's forward: it may sync buffers, which a rank with no batch skips
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:  # every rank scores with rank 0's buffers (BatchNorm statistics), which its checkpoint holds
        for buffer in net.buffers():
            dist.broadcast(buffer, src=0)
    with torch.no_grad():
        sums, count = batch_sums(spec, net, batches, ray.train.torch.get_device())
    keys = sorted(sums)
    if distributed:  # a rank with no batch of the split knows no metric names
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, keys)
        keys = sorted(set().union(*gathered))
    keys = keys or ["loss"]
    # On the device: NCCL reduces CUDA tensors only.
    vector = torch.tensor(
        [sums.get(key, 0.0) for key in keys] + [count], dtype=torch.float64, device=ray.train.torch.get_device()
    )
    if distributed:
        dist.all_reduce(vector)
    *totals, seen = vector.tolist()
    return mean_of({f"{split}_{key}": (total, seen) for key, total in zip(keys, totals, strict=True)})


def mean_of(sums: dict[str, tuple[float, float]]) -> dict[str, float]:
    return {key: total / count if count else float("nan") for key, (total, count) in sums.items()}
