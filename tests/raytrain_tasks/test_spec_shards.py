"""A TrainSpec's Ray Dataset splits on a real worker group: which rows each worker trains on and scores, for splits
kept in the object store (divided on the driver, raytrain_tasks.trainspec.kept_shards) and for streamed ones."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import ray.data
import ray.train
import torch
from ray.train.torch import TorchTrainer

from raytrain_tasks.api import Splits
from raytrain_tasks.trainspec.data import RaySplits, ray_held_out_batches, ray_train_batches, trainer_datasets

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]
WORLD = 2
BATCH = 16
SIZES = {"train": 300, "val": 101, "test": 37}
STARTS = {"train": 0, "val": 1000, "test": 2000}


def _record(config: dict[str, Any]) -> None:
    """On each worker: the row ids of every batch it trains on (epochs 0 and 1) and scores (val, test)."""
    facts: RaySplits = config["facts"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    seen: dict[str, Any] = {}
    for epoch in (0, 1):
        seen[f"train{epoch}"] = [y.tolist() for _, y in ray_train_batches(facts, BATCH, 7, epoch, rank)]
    for name in ("val", "test"):
        seen[name] = [y.tolist() for _, y in ray_held_out_batches(facts, name, BATCH, rank, world)]
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(seen))
    ray.train.report({"done": 1})


def _split(name: str, kept: bool) -> Any:
    start = STARTS[name]
    rows = ray.data.from_items([{"x": [float(i)], "y": i} for i in range(start, start + SIZES[name])])
    return rows if kept else rows.map_batches(lambda batch: batch, batch_format="numpy")  # lazy: streamed


def _assert_equal_disjoint_shards(shards: list[list[int]], what: str) -> None:
    seen = [row for shard in shards for row in shard]
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(SIZES["train"])), what
    # Equal shards (DDP steps in lockstep): fewer than WORLD rows sit out an epoch.
    assert len({len(shard) for shard in shards}) == 1 and SIZES["train"] - len(seen) < WORLD, what


def test_each_worker_trains_on_its_own_rows_and_every_held_out_row_is_scored_once(tmp_path: Path) -> None:
    """One worker group on splits of both kinds, told apart by split: train and test streamed (Ray Train hands
    each worker an equal stream of train; every worker streams test whole and scores every world-th chunk), val
    kept in the object store (each worker scores its own shard, divided on the driver)."""
    splits = Splits(_split("train", False), _split("val", True), _split("test", False), columns=("x", "y"))
    data, divided = trainer_datasets(splits, WORLD)
    assert divided == ("val",)
    # Rows this large would be fetched 64 at a time (FETCH_BYTES): 4 batches per fetch, sliced on the worker.
    facts = RaySplits(splits.columns, torch.zeros(2, 2**16), divided, WORLD)
    assert facts.fetch_rows(BATCH) == 64
    out = tmp_path / "rows"
    out.mkdir()
    previous_handler = signal.getsignal(signal.SIGINT)
    TorchTrainer(
        _record,
        train_loop_config={"facts": facts, "out": str(out)},
        scaling_config=ray.train.ScalingConfig(num_workers=WORLD, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(name="spec-rows", storage_path=str(tmp_path / "runs")),
        **data,
    ).fit()
    signal.signal(signal.SIGINT, previous_handler)  # fit() on the main thread installs its own

    workers = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    for epoch in ("train0", "train1"):
        _assert_equal_disjoint_shards([[row for batch in worker[epoch] for row in batch] for worker in workers], epoch)
        for worker in workers:  # whole batches but the epoch's last, though fetched 64 rows at a time
            assert all(len(batch) == BATCH for batch in worker[epoch][:-1]) and 0 < len(worker[epoch][-1]) <= BATCH
    assert workers[0]["train0"] != workers[0]["train1"], "reshuffled every epoch"
    for name in ("val", "test"):
        scored = sorted(row for worker in workers for batch in worker[name] for row in batch)
        assert scored == list(range(STARTS[name], STARTS[name] + SIZES[name])), f"{name}: each row scored once"


def test_a_kept_train_split_gives_each_worker_an_equal_striped_shard_of_its_own_rows() -> None:
    """A train split kept in the object store is divided on the driver: the trainer's data config (what Ray
    Train's dataset manager calls for the worker group) hands each rank its own shard, equal and disjoint, made of
    stripes along the whole (ordered) split, not one half of it; the same rows every epoch, which the worker's
    local shuffle reorders (ray_train_batches, run in the worker group above)."""
    splits = Splits(_split("train", True), _split("val", True), _split("test", True), columns=("x", "y"))
    data, divided = trainer_datasets(splits, WORLD)
    assert divided == ("test", "train", "val")
    node = ray.get_runtime_context().get_node_id()
    per_rank = data["dataset_config"].configure(data["datasets"], WORLD, None, [node] * WORLD)
    for epoch in (0, 1):
        shards = [
            [row for batch in rank["train"].iter_batches(batch_format="numpy") for row in batch["y"].tolist()]
            for rank in per_rank
        ]
        _assert_equal_disjoint_shards(shards, f"epoch {epoch}")
        for rows in shards:
            assert min(rows) < SIZES["train"] / 10 and max(rows) > SIZES["train"] * 9 / 10, rows
    for name in ("val", "test"):
        scored = sorted(
            row
            for rank in per_rank
            for batch in rank[name].iter_batches(batch_format="numpy")
            for row in batch["y"].tolist()
        )
        assert scored == list(range(STARTS[name], STARTS[name] + SIZES[name])), f"{name}: each row in one shard"
