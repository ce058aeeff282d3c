"""Ray Datasets kept in the object store, divided among a fixed worker group on the driver.

Ray Train's ``DataConfig`` hands every worker a ``streaming_split`` of each split it divides: a coordinator actor
starts every epoch's stream and deals blocks out (a coordinated epoch start cost about 2 s per epoch on 2 CPUs).
A split already materialized (``Dataset.materialize()``, as Ray Data's guide advises for data that fits in the
object store) can instead be divided once, on the driver, into one shard per rank; each worker then iterates its
own blocks every epoch, with no coordinator in between. The division happens on the driver because its tasks need
CPUs that a running worker group holds.
"""

from __future__ import annotations

import itertools
from typing import Any

import ray.data
import ray.train
from ray.data.dataset import MaterializedDataset

STRIPES = 16  # stripes of the train split per worker (_striped)


class KeptShards(ray.train.DataConfig):
    """Ray Train's DataConfig, plus: splits kept in the object store and divided on the driver, one shard per rank,
    are handed out as they are. ``train``'s shards are equal (DDP steps in lockstep, so fewer than world_size rows
    sit out an epoch, as with ``streaming_split(equal=True)``) and striped along the split (``_striped``); the shards
    of ``held_out`` splits (validation, test) are disjoint and cover every row (``equal=False``), so sums over
    them, all-reduced, are exact. A worker group of another size (elastic) gets Ray Train's own handling of every
    split: ``streaming_split`` for ``train``, the whole split to every worker for the others."""

    def __init__(self, shards: dict[str, list[ray.data.Dataset]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shards = shards
        self._world = {len(parts) for parts in shards.values()}

    def configure(
        self,
        datasets: dict[str, ray.data.Dataset],
        world_size: int,
        worker_handles: Any,
        worker_node_ids: Any,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        if self._world != {world_size}:
            return super().configure(datasets, world_size, worker_handles, worker_node_ids, **kwargs)
        rest = {name: ds for name, ds in datasets.items() if name not in self._shards}
        output = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs)
        for name, parts in self._shards.items():
            for rank, shard in enumerate(parts):
                options = self._resolve_execution_options(name)  # as Ray Train sets its own splits'
                options.preserve_order = True  # a shard's blocks (stripes) in order, every epoch, every attempt
                shard.context.execution_options = options
                output[rank][name] = shard.iterator()
        return output

    def divides(self, world_size: int) -> tuple[str, ...]:
        """The splits each of ``world_size`` workers gets as its own shard (not whole, nor streamed)."""
        return tuple(sorted(self._shards)) if self._world == {world_size} else ()


def kept_shards(
    datasets: dict[str, ray.data.Dataset], world_size: int, held_out: tuple[str, ...] = (), **kwargs: Any
) -> KeptShards:
    """The ``dataset_config`` of a TorchTrainer whose worker group has ``world_size`` workers (0: elastic, not
    known here): ``train`` and the ``held_out`` splits divided now when they are materialized; ``kwargs`` for
    Ray Train's DataConfig, which handles every other split (and all of them for another worker count)."""
    shards: dict[str, list[ray.data.Dataset]] = {}
    if world_size > 0:
        for name, dataset in datasets.items():
            if not isinstance(dataset, MaterializedDataset):
                continue
            if name == "train" and (striped := _striped(dataset, world_size)):
                shards[name] = striped
            elif name in held_out:
                shards[name] = list(dataset.split(world_size, equal=False))
    return KeptShards(shards, **kwargs)


def _striped(dataset: MaterializedDataset, world_size: int) -> list[ray.data.Dataset]:
    """``world_size`` equal shards of ``dataset``, each made of ``STRIPES`` stripes taken in turn along it (stripe
    i of rank r is piece i * world_size + r): an ordered table (by time, by label) gives every worker rows from
    all of it, as Ray Train's ``streaming_split`` dealing blocks out in turn does, not one contiguous part each (a
    BatchNorm's per-worker statistics would then differ: tested). Fewer than ``world_size`` rows, the table's end,
    sit out; none when the split has fewer rows than workers (Ray Train's handling then)."""
    each = dataset.count() // world_size  # a materialized dataset knows its rows: no read
    if each == 0:
        return []
    stripes = min(STRIPES, each)
    sizes = [each // stripes + (1 if i < each % stripes else 0) for i in range(stripes)]
    ends = list(itertools.accumulate(size for size in sizes for _ in range(world_size)))
    pieces = dataset.split_at_indices(ends)  # the last piece: the rows that sit out
    shards = []
    for rank in range(world_size):
        own = [pieces[i * world_size + rank] for i in range(stripes)]
        shards.append(own[0].union(*own[1:]) if len(own) > 1 else own[0])
    return shards
