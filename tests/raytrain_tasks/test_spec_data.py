"""A TrainSpec's train split: its order follows the run's `seed`. No Ray."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from raytrain_tasks.trainspec.data import train_loader_of

ROWS = TensorDataset(torch.arange(40).unsqueeze(1), torch.zeros(40))


def _order(seed: int, rank: int, world: int, epoch: int = 0) -> list[int]:
    loader = train_loader_of(ROWS, 4, seed, rank, world)
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)
    torch.manual_seed(seed)  # what the loop does first, for the one-worker order
    return [int(x) for inputs, _ in loader for x in inputs[:, 0]]


def test_the_train_order_follows_the_runs_seed_on_one_worker_and_on_several() -> None:
    """Ray's prepare_data_loader shuffles with a DistributedSampler of seed 0 whatever the run's seed: two runs
    with other seeds saw the same order on two workers. Each worker's share still covers the split once."""
    for world in (1, 2):
        assert _order(1, 0, world) == _order(1, 0, world)
        assert _order(1, 0, world) != _order(2, 0, world), f"{world} worker(s): the seed does not change the order"
    shares = _order(1, 0, 2) + _order(1, 1, 2)
    assert sorted(shares) == list(range(40))
    assert _order(1, 0, 2, epoch=1) != _order(1, 0, 2, epoch=0)  # reshuffled each epoch, as set_epoch asks


def test_a_train_specs_workers_say_each_epoch_in_one_line() -> None:
    """A Ray Job's log is its only progress (no run page on the cluster), and --verbose shows the workers' output:
    rank 0 of a TrainSpec's loop says each committed epoch there, as the built-in classifier's loop does (it said
    nothing). Numbered from 1, the losses and validation figures, not the test split's."""
    from raytrain_tasks.tracking.names import DATASET_DIGEST_KEY
    from raytrain_tasks.trainspec.loop import epoch_line

    reported = {"epoch": 1, "train_loss": 0.2782, "val_loss": 0.18, "val_mae": 0.3, "test_mae": 0.4, "test_loss": 0.5}
    figures = {"epoch_seconds": 0.0947, "samples_per_second": 13537.5, "workers": 2.0, DATASET_DIGEST_KEY: "ab12"}
    line = epoch_line(1, 3, {**reported, **figures}, 0.0123)
    assert line == (
        "epoch 2/3 train_loss=0.2782 val_loss=0.1800 val_mae=0.3000 (0.09 s, 13538 samples/s; checkpoint 0.012 s)"
    )
