"""How workers get their batches: a torch DataLoader over the split, or a Ray Data shard streamed to them.

``torch``: every worker reads the (small) Parquet split and a seeded DistributedSampler picks its rows.
``ray_data``: the driver builds ``read_parquet -> map_batches(standardise)`` pipelines that run as CPU tasks,
once per fit into Ray's object store when the splits fit in a share of it (``data.MATERIALIZE_SHARE``), before
any worker starts; larger data streams through those tasks every epoch, beside the workers. Ray Train splits
the train pipeline into one disjoint, equal-sized shard per worker
(``streaming_split(equal=True)``: up to ``world_size - 1`` rows are left out of an epoch), and every worker
iterates its shard with ``iter_torch_batches``, shuffled locally with a seed derived from (seed, epoch, rank),
in chunks of whole batches that it slices on its device.
"""

from __future__ import annotations

import itertools
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
    check_split_file,
    read_split,
    standardise_batch,
    streams,
)
from raytrain_tasks.kept_shards import kept_shards
from raytrain_tasks.storage.filesystem import open_filesystem

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # features, labels, row indices

# Rows buffered for the per-worker shuffle of a Ray Data shard: the whole shard for small data.
SHUFFLE_BUFFER_ROWS = 10_000
# Rows a worker takes from its shard at a time, sliced into training batches on its device: Ray Data's iterator
# costs about 0.6 ms per batch it yields, as much as a whole step of a small model (make bench measures it).
FETCH_ROWS = 4_096


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
        check_split_file(dataset, split, config.storage_options)  # Ray Data's read tasks do not hash what they read
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


def data_config(train: ray.data.Dataset | None = None, world_size: int = 0) -> ray.train.DataConfig:
    """The ``dataset_config`` of the TorchTrainer; ``world_size``: the worker group's size when it is fixed. Only
    train is sharded: every worker sees the whole validation split and scores its rank's slice, so the all-reduced
    validation metrics cover every row exactly once. A train split kept in the object store is divided on the
    driver (raytrain_tasks.kept_shards)."""
    return kept_shards({} if train is None else {"train": train}, world_size, datasets_to_split=["train"])


class TrainBatches:
    """One worker's training batches, epoch by epoch, whichever loader feeds them."""

    def __init__(self, config: TrainingConfig, dataset: DatasetRef, rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = ray.train.torch.get_device()
        self._warmed: tuple[int, Iterator[Batch]] | None = None
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

    def warm(self, epoch: int) -> None:
        """Start ``epoch``'s stream now, before the training loop: a Ray Data shard's first epoch waits seconds
        for its split coordinator to start, set-up like the torch loader's read of the split."""
        if self.config.data_loader == "ray_data":
            stream = self._chunks(epoch)
            first = next(stream, None)
            self._warmed = (epoch, itertools.chain([] if first is None else [first], stream))

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """(features, labels, row indices) batches on this worker's device; the same for the same epoch."""
        if self.config.data_loader != "ray_data":
            self._sampler.set_epoch(epoch)
            yield from self._loader
            return
        warmed, self._warmed = self._warmed, None
        chunks = warmed[1] if warmed is not None and warmed[0] == epoch else self._chunks(epoch)
        yield from sliced(chunks, self.config.batch_size)

    def _chunks(self, epoch: int) -> Iterator[Batch]:
        seed = _shuffle_seed(self.config.seed, epoch, self.rank)
        return shuffled_chunks(self._shard, self.config.batch_size, seed, self.device)


def shuffled_chunks(data: Any, batch_size: int, seed: int, device: Any = None) -> Iterator[Batch]:
    """(features, labels, rows) of a Ray Data shard or dataset, locally shuffled by ``seed``, in chunks of whole
    batches (about ``FETCH_ROWS`` rows) on ``device``."""
    fetch = max(1, FETCH_ROWS // batch_size) * batch_size  # whole batches per chunk: only the last one is short
    for chunk in data.iter_torch_batches(
        batch_size=fetch,
        dtypes={"features": torch.float32, "label": torch.int64, "row": torch.int64},
        device=device or "cpu",
        local_shuffle_buffer_size=max(SHUFFLE_BUFFER_ROWS, 2 * fetch),
        local_shuffle_seed=seed,
    ):
        yield chunk["features"], chunk["label"], chunk["row"]


def sliced(chunks: Iterator[Batch], batch_size: int) -> Iterator[Batch]:
    """Training batches as views of each chunk: no copy."""
    for features, labels, rows in chunks:
        for start in range(0, len(labels), batch_size):
            end = start + batch_size
            yield features[start:end], labels[start:end], rows[start:end]


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
