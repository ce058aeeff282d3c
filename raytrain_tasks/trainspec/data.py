"""A ``TrainSpec``'s splits, of either kind (``raytrain_tasks.api.Splits``): map-style torch datasets, or Ray
Datasets. What the spec's loop needs of them: their kind, an example batch, this worker's batches of each split.

Ray Datasets: ``train`` is split across the workers by Ray Train (``DATA_CONFIG``: one disjoint shard each);
``val`` and ``test`` are not split (a split with ``equal=True`` would leave rows out of the scores): every worker
streams them whole and scores every world-th batch, and the sums are all-reduced, so the figures are exact over
each whole split.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Subset

from raytrain_tasks.api import Splits
from raytrain_tasks.errors import DatasetError, UserCodeError

SPLIT_NAMES = ("train", "val", "test")
# Rows a worker's train shard is shuffled within, with a seed of (seed, epoch, rank): Ray Data's local shuffle.
SHUFFLE_BUFFER_ROWS = 10_000
FETCH_ROWS = 4_096  # rows taken from a Ray Data iterator at a time (RaySplits.fetch_rows)
FETCH_BYTES = 16 * 2**20  # ... and at most this many bytes of inputs


def is_ray_dataset(dataset: Any) -> bool:
    """A ``ray.data.Dataset`` (checked by its class's module, so torch-only code never imports Ray Data)."""
    return any(klass.__module__.startswith("ray.data") for klass in type(dataset).__mro__)


def is_materialized(dataset: Any) -> bool:
    """A Ray Dataset kept in the object store (``materialize()``): iterating it runs no read or transform task."""
    from ray.data.dataset import MaterializedDataset

    return isinstance(dataset, MaterializedDataset)


def uses_ray_data(splits: Splits) -> bool:
    """Whether the splits are Ray Datasets; UserCodeError for a mixture (one kind for all three)."""
    kinds = {name: is_ray_dataset(getattr(splits, name)) for name in SPLIT_NAMES if getattr(splits, name) is not None}
    if len(set(kinds.values())) > 1:
        raise UserCodeError(
            "TrainSpec.data returned Splits of two kinds ("
            + ", ".join(f"{name}: {'a Ray Dataset' if ray else 'a torch Dataset'}" for name, ray in kinds.items())
            + "): give all three as torch Datasets, or all three as Ray Datasets"
        )
    return any(kinds.values())


def check_ray_splits(splits: Splits) -> None:
    """Every Ray Dataset split has a row and the two columns ``Splits.columns`` names (from its first row and its
    schema, without reading it whole); DatasetError naming the split otherwise."""
    for name in SPLIT_NAMES:
        if not getattr(splits, name).take(1):
            raise DatasetError(f"TrainSpec.data returned an empty {name} split (a Ray Dataset with no row)")
        schema = getattr(splits, name).schema(fetch_if_missing=True)
        have = list(schema.names) if schema is not None else []
        if missing := [column for column in splits.columns if column not in have]:
            raise DatasetError(
                f"TrainSpec.data's {name} split (a Ray Dataset) has no column {', '.join(map(repr, missing))} "
                f"(its columns: {', '.join(map(repr, have)) or 'none'}); name its inputs' and target's columns "
                f"with Splits(..., columns=(inputs, target))"
            )


def data_digest(splits: Splits) -> str:
    """SHA-256 over every item of every split, in order: the data's content, for lineage and for a resume."""
    digest = hashlib.sha256()
    for name in ("train", "val", "test"):
        dataset = getattr(splits, name)
        digest.update(f"{name}:{0 if dataset is None else len(dataset)}".encode())
        for index in range(0 if dataset is None else len(dataset)):
            for part in dataset[index]:
                digest.update(torch.as_tensor(part).detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def example_inputs(splits: Splits, rows: int) -> Any:
    """The first ``rows`` train inputs, as a batch: what builds the model (shapes) and the exported example."""
    if is_ray_dataset(splits.train):
        batch = splits.train.take_batch(rows, batch_format="numpy")
        return torch.tensor(batch[splits.columns[0]])  # a copy: Ray's arrays are read-only
    from torch.utils.data import DataLoader

    inputs, _ = next(iter(DataLoader(splits.train, batch_size=rows)))
    return inputs


@dataclass(frozen=True)
class RaySplits:
    """What a worker needs of Ray Dataset splits besides its shards, found once on the driver: the columns and an
    example batch (for the model's shapes). A worker never calls ``data()`` for them, so a ``data()`` that
    materializes its splits (as Ray Data's guide advises for data that fits in the object store) runs once.
    ``divided``: the splits the driver divided into one shard per rank for a group of ``world`` workers
    (raytrain_tasks.trainspec.kept_shards); a group of another size gets them as Ray Train hands them out."""

    columns: tuple[str, str]
    example: Any
    divided: tuple[str, ...] = ()
    world: int = 0

    def own_shard(self, name: str, world: int) -> bool:
        """Whether this worker's ``name`` is its own shard of the split, not the whole split."""
        return name in self.divided and world == self.world

    def fetch_rows(self, batch_size: int) -> int:
        """Rows taken from a Ray Data iterator at a time, in whole batches, sliced into training batches on the
        device: its iterator costs about 0.6 ms per batch it yields, as much as a whole step of a small model.
        About FETCH_ROWS rows, fewer where rows are large (FETCH_BYTES), never less than one batch."""
        example = self.example
        row_bytes = example[0].numel() * example.element_size() if isinstance(example, torch.Tensor) else 0
        rows = min(FETCH_ROWS, FETCH_BYTES // row_bytes) if row_bytes else batch_size
        return max(1, rows // batch_size) * batch_size


def ray_train_batches(facts: RaySplits, batch_size: int, seed: int, epoch: int, rank: int) -> Iterator[Any]:
    """This worker's shard of ``train`` for ``epoch``: (inputs, targets) on its device, shuffled locally."""
    import ray.train

    fetch = facts.fetch_rows(batch_size)
    chunks = ray.train.get_dataset_shard("train").iter_torch_batches(
        batch_size=fetch,
        local_shuffle_buffer_size=max(SHUFFLE_BUFFER_ROWS, 2 * fetch),
        local_shuffle_seed=(seed * 100_003 + epoch) * 1_009 + rank,
    )
    yield from _sliced(chunks, facts.columns, batch_size)


def ray_held_out_batches(facts: RaySplits, name: str, batch_size: int, rank: int, world: int) -> Iterator[Any]:
    """This rank's batches of the ``name`` split: all of its own shard when the driver divided the split, else
    those of every world-th chunk of the whole split (which every worker streams, in the same order)."""
    import ray.train

    chunks = ray.train.get_dataset_shard(name).iter_torch_batches(batch_size=facts.fetch_rows(batch_size))
    if not facts.own_shard(name, world):
        chunks = (chunk for index, chunk in enumerate(chunks) if index % world == rank)
    yield from _sliced(chunks, facts.columns, batch_size)


def _sliced(chunks: Iterator[dict[str, Any]], columns: tuple[str, str], batch_size: int) -> Iterator[Any]:
    """(inputs, targets) batches as views of each chunk: no copy."""
    inputs, target = columns
    for chunk in chunks:
        x, y = chunk[inputs], chunk[target]
        for start in range(0, len(y), batch_size):
            yield x[start : start + batch_size], y[start : start + batch_size]


def driver_batches(splits: Splits, name: str, batch_size: int) -> Iterator[Any]:
    """The whole ``name`` split, here (the driver: a gate's ``evaluate``), whichever its kind."""
    dataset = getattr(splits, name)
    if is_ray_dataset(dataset):
        inputs, target = splits.columns
        for batch in dataset.iter_torch_batches(batch_size=batch_size):
            yield batch[inputs], batch[target]
        return
    from torch.utils.data import DataLoader

    yield from DataLoader(dataset, batch_size=batch_size)


def trainer_datasets(splits: Splits, world_size: int) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(``TorchTrainer``'s ``datasets=`` and ``dataset_config=`` for Ray Dataset splits, the splits divided now).
    ``train`` split across the workers; ``val`` and ``test`` whole to each, in order (every worker sees the same
    chunks, of which each scores every world-th: a partition of the split only if the order is the same
    everywhere). Splits kept in the object store (materialized) are divided here instead, one shard per rank of
    a group of ``world_size`` workers (0: elastic), so no coordinator starts every epoch's stream."""
    import ray.train

    from raytrain_tasks.trainspec.kept_shards import kept_shards

    in_order = ray.train.DataConfig.default_ingest_options()
    in_order.preserve_order = True
    datasets = {name: getattr(splits, name) for name in SPLIT_NAMES}
    config = kept_shards(
        datasets,
        world_size,
        held_out=("val", "test"),
        datasets_to_split=["train"],
        execution_options={"val": in_order, "test": in_order},
    )
    return {"datasets": datasets, "dataset_config": config}, config.divides(world_size)


def quiet_ray_data() -> None:
    """No progress bars or execution plans from Ray Data in this process (one line per epoch is the pipeline's):
    set before the Datasets are built, which take the context as it is then."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # each execution's plan
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "Progress bars disabled": we did
    # Ray Train's own state export reads a deprecated option of Ray Data (Ray 2.60): nothing the user can change.
    warnings.filterwarnings("ignore", message=r".*ExecutionOptions\.exclude_resources. is deprecated")


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """This rank's share of the train split, shuffled by ``seed`` and the epoch (DistributedSampler's order, which
    draws nothing from the global RNG), able to start an epoch part-way: ``start_at(epoch, rows)`` makes that
    epoch's pass begin after the first ``rows`` of the epoch's order over all ranks, as a checkpoint within it left
    off. The rows left are dealt to the ranks there are now, so a group of another size (an elastic group after a
    node was lost) still trains each row of the epoch once. Being a DistributedSampler, ``prepare_data_loader``
    keeps it."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self._skip: tuple[int, int] | None = None  # (epoch, rows) for the next pass

    def start_at(self, epoch: int, rows: int) -> None:
        self.set_epoch(epoch)
        self._skip = (epoch, rows)

    def __iter__(self) -> Iterator[int]:
        if self._skip is None or self._skip[0] != self.epoch:
            return super().__iter__()
        rows, self._skip = self._skip[1], None
        return iter(self._rest(rows))

    def __len__(self) -> int:
        if self._skip is None or self._skip[0] != self.epoch:
            return int(self.num_samples)
        return len(self._rest(self._skip[1]))

    def _rest(self, rows: int) -> list[int]:
        """This rank's share of the epoch's order after its first ``rows``. With the group size the rows were
        trained with, exactly what the uninterrupted pass would have given it next: DistributedSampler pads the
        order with its own head to a multiple of the ranks, and deals every world-th row to each."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order: list[int] = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        rest = order[min(rows, len(order)) :]
        padding = -len(rest) % self.num_replicas
        rest += (order * (padding // max(len(order), 1) + 1))[:padding]
        return rest[self.rank :: self.num_replicas]


def train_loader_of(dataset: Any, batch_size: int, seed: int, rank: int, world: int) -> DataLoader[Any]:
    """The train split's loader: each rank's share in an order of the run's ``seed`` and the epoch
    (``ResumableSampler``), so a checkpoint within an epoch can say where the next step starts. Its own generator
    draws the loader's worker seed: iterating it leaves the global RNG, which a checkpoint holds, as it was.
    (``prepare_data_loader`` would add a DistributedSampler of seed 0 whatever the run's seed is.)"""
    sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed))


def slice_batches(dataset: Any, rank: int, world: int, batch_size: int) -> Any:
    """This rank's disjoint, unpadded slice of a map-style split: every world-th item."""
    return DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=batch_size)


def epoch_figures(loss_total: torch.Tensor, rows: int, started: float, device: Any) -> dict[str, float]:
    """An epoch's train loss over every worker's rows (not rank 0's alone), and how fast the group trained: the
    epoch's seconds, the train rows of all workers per second, and the number of workers. Every rank calls it."""
    sums = torch.tensor([float(loss_total), float(rows)], dtype=torch.float64, device=device)  # NCCL: on the device
    world = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
        world = dist.get_world_size()
    total, count = sums.tolist()
    seconds = time.perf_counter() - started
    return {
        "train_loss": total / count if count else math.nan,
        "epoch_seconds": seconds,
        "samples_per_second": count / seconds if seconds > 0 else math.nan,
        "workers": float(world),
    }
