"""How workers get their batches: a torch DataLoader over the split, or a Ray Data shard streamed to them.

``torch``: every worker reads the (small) Parquet split and a seeded DistributedSampler picks its rows.
``ray_data``: the driver builds ``read_parquet -> map_batches(standardise)`` pipelines that run as CPU tasks,
once per fit into Ray's object store when the splits fit in a share of it (``data.MATERIALIZE_SHARE``), before
any worker starts; larger data streams through those tasks every epoch, beside the workers. Ray Train splits
the train pipeline into one disjoint, equal-sized shard per worker
(``streaming_split(equal=True)``: up to ``world_size - 1`` rows are left out of an epoch), and every worker
iterates its shard with ``iter_torch_batches``, shuffled locally with a seed derived from (seed, epoch, rank).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray.data
import ray.train
import ray.train.torch
import torch

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.data import (
    DATA_TASK_CPUS,
    MATERIALIZE_SHARE,
    DatasetRef,
    Split,
    read_split,
    standardise_batch,
    streams,
)
from raytrain_tasks.fs import open_filesystem

logger = logging.getLogger(__name__)

# Rows buffered for the per-worker shuffle of a Ray Data shard: the whole shard for small data.
SHUFFLE_BUFFER_ROWS = 10_000


def ray_datasets(
    config: TrainingConfig, dataset: DatasetRef, log: logging.Logger | logging.LoggerAdapter[Any] = logger
) -> dict[str, ray.data.Dataset]:
    """The ``datasets=`` of the TorchTrainer: the standardised train and val splits, preprocessed now and kept in
    the object store when they fit, else lazy pipelines that Ray Train's workers stream."""
    context = ray.data.DataContext.get_current()
    # One log line per epoch is ours; Ray Data's progress bars and per-execution plans flood the flow logs.
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    context.execution_options.preserve_order = True  # same blocks to the same shard, run after run
    pipelines = {}
    for split in ("train", "val"):
        filesystem, path = open_filesystem(dataset.split_uri(split), config.storage_options)
        pipelines[split] = ray.data.read_parquet(path, filesystem=filesystem, num_cpus=DATA_TASK_CPUS).map_batches(
            standardise_batch,  # type: ignore[arg-type]  # extra keyword argument via fn_kwargs
            fn_kwargs={"dataset": dataset},
            batch_format="numpy",
            num_cpus=DATA_TASK_CPUS,
        )
    object_store = ray.cluster_resources().get("object_store_memory", 0.0)
    if streams(config.data_loader, dataset, object_store):
        log.info(
            "Ray Data streams the splits (%.0f MiB preprocessed, over %.0f%% of the object store's %.0f MiB): "
            "read and preprocessed every epoch",
            dataset.preprocessed_bytes / 2**20,
            100 * MATERIALIZE_SHARE,
            object_store / 2**20,
        )
        return pipelines
    # Preprocessed once per fit, by tasks that finish before the workers start: every epoch (and a restarted
    # worker group) iterates the same blocks, in order, from the object store.
    started = time.perf_counter()
    kept = {split: pipeline.materialize() for split, pipeline in pipelines.items()}
    log.info(
        "Ray Data preprocessed the splits once for this fit (%.0f MiB in the object store) in %.1fs",
        dataset.preprocessed_bytes / 2**20,
        time.perf_counter() - started,
    )
    return kept


def data_config() -> ray.train.DataConfig:
    # Only train is sharded: every worker sees the whole validation split and scores its rank's slice,
    # so the all-reduced validation metrics cover every row exactly once.
    return ray.train.DataConfig(datasets_to_split=["train"])


class TrainBatches:
    """One worker's training batches, epoch by epoch, whichever loader feeds them."""

    def __init__(self, config: TrainingConfig, dataset: DatasetRef, rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = ray.train.torch.get_device()
        if config.data_loader == "ray_data":
            self._shard = ray.train.get_dataset_shard("train")
            return
        x_train, y_train = read_split(dataset, "train", config.storage_options)
        rows = torch.arange(len(y_train), dtype=torch.int64)
        train_set = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train), rows)
        # Seeded sampler, re-seeded each epoch by set_epoch: the shuffle order depends on (seed, epoch) alone,
        # so an epoch replayed after a restart sees the same batches. drop_last, like Ray Data's equal split:
        # a row is seen at most once per epoch (padding would repeat some), and fewer than world_size are left.
        self._sampler: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(
            train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed, drop_last=True
        )
        self._loader = ray.train.torch.prepare_data_loader(
            torch.utils.data.DataLoader(
                train_set, batch_size=config.batch_size, sampler=self._sampler, pin_memory=config.use_gpu
            )
        )

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(features, labels, row indices) batches on this worker's device; the same for the same epoch."""
        if self.config.data_loader != "ray_data":
            self._sampler.set_epoch(epoch)
            yield from self._loader
            return
        for batch in self._shard.iter_torch_batches(
            batch_size=self.config.batch_size,
            dtypes={"features": torch.float32, "label": torch.int64, "row": torch.int64},
            device=self.device,
            local_shuffle_buffer_size=SHUFFLE_BUFFER_ROWS,
            local_shuffle_seed=_shuffle_seed(self.config.seed, epoch, self.rank),
        ):
            yield batch["features"], batch["label"], batch["row"]


def validation_slice(
    config: TrainingConfig, dataset: DatasetRef, rank: int, world_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's disjoint slice of the whole validation split (standardised), from either loader."""
    if config.data_loader == "ray_data":
        features, labels = _collect_in_row_order(ray.train.get_dataset_shard("val"), "val")
    else:
        features, labels = read_split(dataset, "val", config.storage_options)
    return features[rank::world_size], labels[rank::world_size]


def _collect_in_row_order(shard: Any, split: Split) -> tuple[np.ndarray, np.ndarray]:
    parts = list(shard.iter_batches(batch_size=None, batch_format="numpy"))
    if not parts:
        raise ValueError(f"the {split} split streamed no rows")
    rows = np.concatenate([p["row"] for p in parts])
    order = np.argsort(rows, kind="stable")
    features = np.concatenate([p["features"] for p in parts])[order]
    labels = np.concatenate([p["label"] for p in parts])[order]
    return features.astype(np.float32, copy=False), labels.astype(np.int64, copy=True)


def _shuffle_seed(seed: int, epoch: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 1_009 + rank) % (2**32)
