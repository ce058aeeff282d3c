"""``train_loop_per_worker``: what each Ray Train worker runs.

Every epoch ends in ``ray.train.report`` on all ranks (it is a barrier); rank 0 attaches the checkpoint.
A restarted worker group resumes from ``ray.train.get_checkpoint()``: model, optimizer, RNG state and the
epoch to start from, so a resumed run follows the same trajectory as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch import nn

from raytrain_tasks.checkpoint import (
    ModelSpec,
    TrainingState,
    capture_rng_state,
    manifest_digest,
    restore_rng_state,
    save_checkpoint,
    this_runs_staging_folder,
)
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.data import DatasetRef
from raytrain_tasks.ingest import TrainBatches, validation_slice
from raytrain_tasks.models import build_model
from raytrain_tasks.resume import CheckpointPins, checkpoint_dir_name, existing_checkpoint_names, load_newest_intact
from raytrain_tasks.tracking.controller import MANIFEST_METRIC, epoch_number
from raytrain_tasks.worker_log import configure_worker_logging

logger = logging.getLogger(__name__)


class WorkerSpec(BaseModel):
    """What crosses into Ray as ``train_loop_config``; validated again on every worker."""

    model_config = ConfigDict(frozen=True)

    config: TrainingConfig
    cpus_per_worker: float  # the worker's CPU share (the driver's plan: the setting, or sized to the cluster)
    dataset: DatasetRef
    # Checkpoint folders of this run that existed when the fit started, and the manifest digests MLflow holds
    # for them: one of those folders is resumed from only if its manifest still has that digest.
    preexisting: frozenset[str] = frozenset()
    pinned: dict[str, str] = {}


def torch_threads(cpus_per_worker: float) -> int:
    """Intra-op threads for a worker's CPU share, to the nearest whole CPU (1.9 CPUs: 2 threads), at least one."""
    return max(1, int(cpus_per_worker + 0.5))


def model_spec(config: TrainingConfig, dataset: DatasetRef) -> ModelSpec:
    return ModelSpec(
        model=config.model,
        in_features=dataset.num_features,
        num_classes=dataset.num_classes,
        hidden_sizes=tuple(config.hidden_sizes),
        feature_names=dataset.feature_names,
        class_labels=dataset.class_labels,
    )


def _train_epoch(model: Any, optimizer: Any, loss_fn: Any, epoch_batches: Any, device: Any) -> tuple[Any, int]:
    """One pass over this rank's batches: (summed training loss as a float64 tensor on the device, samples)."""
    model.train()
    # Metrics accumulate on the device: no per-step .item(), which would make the host wait for the GPU at
    # every step. The one transfer per epoch is the all-reduced sums of the caller.
    train_loss_total = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    for features, labels, _ in epoch_batches:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(features), labels)
        (loss / labels.shape[0]).backward()
        optimizer.step()
        train_loss_total += loss.detach().to(torch.float64)
        samples += labels.shape[0]  # a shape is known on the host
    return train_loss_total, samples


def _validate(model: Any, val_x: Any, val_y: Any, loss_fn: Any, batch_size: int) -> tuple[Any, Any]:
    """This rank's summed validation loss and correct predictions (float64 tensors on its device)."""
    model.eval()
    val_loss_total = torch.zeros((), dtype=torch.float64, device=val_x.device)
    correct = torch.zeros((), dtype=torch.float64, device=val_x.device)
    with torch.no_grad():  # batch_size rows per forward pass: a large split never needs one pass's memory
        for start in range(0, len(val_y), batch_size):
            logits = model(val_x[start : start + batch_size])
            labels = val_y[start : start + batch_size]
            val_loss_total += loss_fn(logits, labels).to(torch.float64)
            correct += (logits.argmax(1) == labels).sum().to(torch.float64)
    return val_loss_total, correct


def _restore(spec: WorkerSpec, net: Any, rank: int) -> tuple[int, list[dict[str, float]], Any, Any, frozenset[str]]:
    """Where this worker starts: (first epoch, history, RNG state, optimizer state, checkpoint names it must not
    write into), with ``net`` loaded from the newest intact pinned checkpoint when there is one."""
    # A folder left by an earlier attempt (even one Ray never registered: killed mid-upload) is never written
    # into again.
    taken = spec.preexisting
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, [], None, None, taken
    taken |= existing_checkpoint_names(checkpoint)
    loaded, checkpoint = load_newest_intact(
        checkpoint, announce=rank == 0, pins=CheckpointPins(spec.preexisting, spec.pinned)
    )
    net.load_state_dict(loaded.model_state)
    start_epoch = loaded.state.epoch + 1
    if rank == 0:
        logger.info("resuming from %s: next epoch %d", checkpoint.path, epoch_number(start_epoch))
    return start_epoch, list(loaded.state.history), loaded.rng_state, loaded.optimizer_state, taken


def train_loop_per_worker(train_loop_config: dict[str, Any]) -> None:
    spec = WorkerSpec.model_validate(train_loop_config)
    config, dataset = spec.config, spec.dataset
    configure_worker_logging()
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    # Ray does not cap intra-op threads the way torchrun does; oversubscribed cores slow every rank.
    torch.set_num_threads(torch_threads(spec.cpus_per_worker))
    _seed_everything(config.seed)

    batches = TrainBatches(config, dataset, rank, world_size)
    # Validation slices are disjoint and unpadded (a DistributedSampler would repeat rows), so the
    # all-reduced sums give the exact accuracy over the whole validation split.
    x_val, y_val = validation_slice(config, dataset, rank, world_size)
    val_x, val_y = torch.from_numpy(x_val).to(device), torch.from_numpy(y_val).to(device)

    net = build_model(config.model, dataset.num_features, dataset.num_classes, config.hidden_sizes)
    start_epoch, history, rng_state, optimizer_state, taken = _restore(spec, net, rank)

    model = ray.train.torch.prepare_model(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    if rng_state is not None:
        restore_rng_state(rng_state)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    if start_epoch < config.epochs:
        batches.warm(start_epoch)
    for epoch in range(start_epoch, config.epochs):
        started = time.perf_counter()
        train_loss_total, samples = _train_epoch(model, optimizer, loss_fn, batches.epoch(epoch), device)
        val_loss_total, correct = _validate(model, val_x, val_y, loss_fn, config.batch_size)
        counts = torch.tensor([samples, len(val_y)], dtype=torch.float64, device=device)
        sums = torch.stack([train_loss_total, counts[0], val_loss_total, correct, counts[1]])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        train_loss_sum, train_count, val_loss_sum, val_correct, val_count = sums.tolist()
        seconds = time.perf_counter() - started
        metrics = {
            "epoch": epoch,
            "train_loss": train_loss_sum / train_count,
            "val_loss": val_loss_sum / val_count,
            "val_accuracy": val_correct / val_count,
            "epoch_seconds": seconds,
            "samples_per_second": train_count / seconds if seconds > 0 else math.nan,
            "workers": world_size,
        }
        history.append({k: float(v) for k, v in metrics.items()})
        _report(config, dataset, epoch, metrics, history, model, optimizer, rank, taken)


def _report(
    config: TrainingConfig,
    dataset: DatasetRef,
    epoch: int,
    metrics: dict[str, float],
    history: list[dict[str, float]],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    taken: frozenset[str],
) -> None:
    if rank != 0:
        # report() is a barrier: every rank calls it, only rank 0 carries the checkpoint.
        ray.train.report(metrics, checkpoint=None)
        return
    started = time.perf_counter()
    net = getattr(model, "module", model)
    state = TrainingState(
        epoch=epoch,
        metrics={k: float(v) for k, v in metrics.items()},
        spec=model_spec(config, dataset),
        history=history,
    )
    with this_runs_staging_folder() as tmp:
        save_checkpoint(
            tmp,
            state=state,
            model_state={k: v.detach().cpu() for k, v in net.state_dict().items()},
            optimizer_state=optimizer.state_dict(),
            rng_state=capture_rng_state(),
        )
        ray.train.report(
            {**metrics, MANIFEST_METRIC: manifest_digest(tmp)},
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=checkpoint_dir_name(epoch, taken),
        )
    # One line per epoch; the checkpoint figure is what the epoch boundary cost (save, upload, report barrier).
    logger.info(
        "epoch %d/%d train_loss=%.4f val_loss=%.4f val_accuracy=%.4f (%.2fs, %.0f samples/s; checkpoint %.3fs)",
        epoch_number(epoch),
        config.epochs,
        metrics["train_loss"],
        metrics["val_loss"],
        metrics["val_accuracy"],
        metrics["epoch_seconds"],
        metrics["samples_per_second"],
        time.perf_counter() - started,
    )


def _seed_everything(seed: int) -> None:
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
