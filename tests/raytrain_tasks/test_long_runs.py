"""The rules of long runs, without a fit: when a checkpoint within an epoch is due, which settings a run's code and
data cannot honour, how long a collective waits, how checkpoint folders within epochs are named and ordered, and
where a resumed epoch's loader starts. A fit that fails within an epoch and ends as the uninterrupted one:
tests/raytrain_driver/test_long_runs_fit.py."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from pydantic import ValidationError
from torch.utils.data import DataLoader, TensorDataset

from raytrain_tasks.checked_reports import UNSCORED, ranking_score
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.long_runs import (
    RecordedEpoch,
    StepCheckpoints,
    checkpoint_within_epoch,
    hang_timeout_refusal,
    hang_timeout_s,
    recorded_epochs,
    silent_ranks,
    step_checkpoint_refusal,
    step_time_refusal,
)
from raytrain_tasks.tracking.names import CHECKPOINT_PREFIX, EPOCH_FOLDER, checkpoint_order, within_epoch
from raytrain_tasks.trainspec.data import ResumableSampler, train_loader_of
from raytrain_tasks.trainspec.resume import checkpoint_dir_name


@pytest.mark.parametrize(
    ("every_steps", "every_minutes", "steps_since", "seconds_since", "due"),
    [
        (0, 0, 10**6, 10**6, False),  # off: epoch ends only
        (50, 0, 49, 10**6, False),
        (50, 0, 50, 0, True),
        (50, 0, 51, 0, True),  # a count that went past (a resumed epoch) is still due
        (0, 2, 10**6, 119.9, False),
        (0, 2, 1, 120, True),
        (50, 2, 10, 120, True),  # either trigger
        (50, 2, 50, 1, True),
        (50, 2, 10, 1, False),
    ],
)
def test_a_checkpoint_is_due_after_its_steps_or_its_minutes(
    every_steps: int, every_minutes: float, steps_since: int, seconds_since: float, due: bool
) -> None:
    assert StepCheckpoints(every_steps, every_minutes).due(steps_since, seconds_since) is due


@pytest.mark.parametrize(
    ("due", "epoch_step", "steps_in_epoch", "commits"),
    [
        (True, 5, 13, True),
        (True, 13, 13, False),  # the epoch's last step: its own checkpoint, with its scores, follows at once
        (False, 5, 13, False),
        (True, 5, None, True),  # a loader of unknown length: every due step
    ],
)
def test_no_checkpoint_within_an_epoch_at_its_last_step(
    due: bool, epoch_step: int, steps_in_epoch: int | None, commits: bool
) -> None:
    assert checkpoint_within_epoch(due, epoch_step, steps_in_epoch) is commits


@pytest.mark.parametrize(
    ("checkpoints", "spec_loop", "ray_data", "says"),
    [
        (StepCheckpoints(), False, True, None),  # not asked: nothing to refuse
        (StepCheckpoints(50), True, False, None),  # a TrainSpec on torch Datasets
        (StepCheckpoints(0, 5), True, False, None),
        (
            StepCheckpoints(50),
            False,
            False,
            "checkpoint_every_steps=50 (--checkpoint-every-steps) applies to a TrainSpec",
        ),
        (
            StepCheckpoints(0, 5),
            False,
            False,
            "checkpoint_every_minutes=5 (--checkpoint-every-minutes) applies to a TrainSpec",
        ),
        (StepCheckpoints(50), True, True, "ray-project/ray#37633"),
    ],
)
def test_step_checkpoints_are_refused_where_a_resume_could_not_continue_exactly(
    checkpoints: StepCheckpoints, spec_loop: bool, ray_data: bool, says: str | None
) -> None:
    why = step_checkpoint_refusal(checkpoints, spec_loop, ray_data)
    assert (why is None) if says is None else (why is not None and says in why), why


@pytest.mark.parametrize(
    ("setting", "use_gpu", "seconds"), [(0, False, 600.0), (0, True, 1800.0), (45, False, 45.0), (45, True, 45.0)]
)
def test_the_hang_timeout_is_the_setting_or_the_devices_default(setting: float, use_gpu: bool, seconds: float) -> None:
    assert hang_timeout_s(setting, use_gpu) == seconds


@pytest.mark.parametrize(("setting", "refused"), [(0, False), (29.9, True), (30, False), (3600, False)])
def test_a_hang_timeout_too_short_to_tell_a_hang_from_a_pause_is_refused(setting: float, refused: bool) -> None:
    assert (hang_timeout_refusal(setting) is not None) is refused


RUN = "MLflow run 0a1b of run key K"


@pytest.mark.parametrize(
    ("setting", "use_gpu", "epochs", "refused"),
    [
        (60, False, [], False),  # a new run: nothing measured
        (60, False, [RecordedEpoch(1, 5000.0)], False),  # no step count: not comparable (the floor holds)
        (60, False, [RecordedEpoch(1, 2000.0, 100)], False),  # 20 s a step: 3 steps fit exactly
        (59, False, [RecordedEpoch(1, 2000.0, 100)], True),
        (59, False, [RecordedEpoch(1, 1000.0, 100), RecordedEpoch(2, 5000.0)], False),  # only the counted epoch
        (90, False, [RecordedEpoch(1, 1000.0, 100), RecordedEpoch(2, 4000.0, 100)], True),  # the slowest decides
        (0, False, [RecordedEpoch(1, 25000.0, 100)], True),  # 250 s a step: over the CPU default's third
        (0, True, [RecordedEpoch(1, 25000.0, 100)], False),  # the GPU default holds it
        (3600, True, [RecordedEpoch(1, 25000.0, 100)], False),
    ],
)
def test_a_hang_timeout_under_three_recorded_steps_is_refused(
    setting: float, use_gpu: bool, epochs: list[RecordedEpoch], refused: bool
) -> None:
    assert (step_time_refusal(setting, use_gpu, epochs, RUN) is not None) is refused


@pytest.mark.parametrize(
    ("setting", "use_gpu", "named"),
    [(59, False, "hang_timeout_s=59 is shorter"), (0, False, "hang_timeout_s=0 (the default, 600 s on CPUs)")],
)
def test_the_step_time_refusal_names_the_setting_the_step_the_run_and_what_to_give(
    setting: float, use_gpu: bool, named: str
) -> None:
    epochs = [RecordedEpoch(1, 1000.0, 100), RecordedEpoch(2, 30000.0, 120)]  # epoch 2: 250 s a step
    why = step_time_refusal(setting, use_gpu, epochs, RUN)
    assert why is not None and named in why, why
    assert f"{RUN} took 250.0 s per step in epoch 2 (30000.0 s over 120 steps)" in why, why
    assert why.endswith("Give hang_timeout_s 750 or more"), why


@pytest.mark.parametrize(
    ("logged", "steps"),
    [
        ([(1, 10.0, 50), (2, 10.0, 100)], [50, 50]),  # global steps at epoch ends: each epoch's is the difference
        ([(1, 10.0, 50), (2, 10.0, 80)], [50, 30]),  # fewer steps (more workers, each a larger share)
        ([(1, 10.0, None), (2, 10.0, 100)], [None, None]),  # no step reported at the end before: unknown
        ([(2, 10.0, 100), (3, 10.0, 150)], [None, 50]),  # the epoch before is not in the history
        ([(1, 10.0, 50), (2, 10.0, 50)], [50, None]),  # a count that starts again each epoch: not a global step
        ([(1, 10.0, 50), (2, 9.0, 100), (2, 10.0, 100), (3, 10.0, 150)], [50, 50, 50, 50]),  # epoch 2 retrained
    ],
)
def test_an_epochs_steps_are_its_global_step_less_the_epoch_befores(
    logged: list[tuple[int, float, int | None]], steps: list[int | None]
) -> None:
    assert [epoch.steps for epoch in recorded_epochs(logged)] == steps


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"checkpoint_every_steps": -1}, "checkpoint_every_steps"),
        ({"checkpoint_every_minutes": -0.5}, "checkpoint_every_minutes"),
        ({"hang_timeout_s": -1}, "hang_timeout_s"),
        ({"hang_timeout_s": 5}, "hang_timeout_s"),
    ],
)
def test_bad_long_run_settings_are_refused_naming_the_setting(settings: dict[str, float], named: str) -> None:
    with pytest.raises(ValidationError) as refused:
        TrainingConfig(**settings)  # type: ignore[arg-type]
    assert refused.value.errors()[0]["loc"] == (named,), refused.value


def test_checkpoint_folders_within_epochs_are_named_and_ordered_by_epoch_then_step() -> None:
    """Oldest first: an epoch's checkpoints within it by step, then its own; a retraining after them."""
    names = [
        checkpoint_dir_name(0, global_step=5),
        checkpoint_dir_name(0, global_step=10),
        checkpoint_dir_name(0),
        checkpoint_dir_name(1, global_step=18),
        checkpoint_dir_name(1, frozenset({"epoch-0002-step-00000018"}), global_step=18),
        checkpoint_dir_name(1),
        checkpoint_dir_name(9999, global_step=10**9),
        checkpoint_dir_name(10_000),
    ]
    assert names[:6] == [
        "epoch-0001-step-00000005",
        "epoch-0001-step-00000010",
        "epoch-0001",
        "epoch-0002-step-00000018",
        "epoch-0002-step-00000018-r1",
        "epoch-0002",
    ]
    assert all(EPOCH_FOLDER.fullmatch(name) for name in names), names
    assert sorted(reversed(names), key=checkpoint_order) == names
    assert [within_epoch(name) for name in names] == [True, True, False, True, True, False, True, False]
    for planted in ("epoch-0001-step-5", "epoch-0001-step-00000005.tmp", f"{CHECKPOINT_PREFIX}planted"):
        assert not EPOCH_FOLDER.fullmatch(planted) and not within_epoch(planted)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_resumed_epochs_loader_yields_the_rest_of_each_ranks_order(world: int) -> None:
    """Each rank's loader, started after the `step * batch_size * world` rows every rank trained, yields exactly the
    batches the whole pass yields after `step` steps; the epoch after it is whole again; iterating draws nothing
    from the global RNG."""
    rows = TensorDataset(torch.arange(103))
    batch, step, epoch = 4, 5, 2
    for rank in range(world):
        whole = train_loader_of(rows, batch, seed=3, rank=rank, world=world)
        whole.sampler.set_epoch(epoch)
        expected = [b[0].tolist() for b in whole][step:]
        resumed = train_loader_of(rows, batch, seed=3, rank=rank, world=world)
        sampler = resumed.sampler
        assert isinstance(sampler, ResumableSampler)
        sampler.start_at(epoch, step * batch * world)
        before = torch.get_rng_state()
        assert len(resumed) == len(expected)
        assert [b[0].tolist() for b in resumed] == expected
        assert torch.equal(torch.get_rng_state(), before)
        sampler.set_epoch(epoch + 1)
        whole.sampler.set_epoch(epoch + 1)
        assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in whole]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (3, 2), (2, 3)])
def test_a_group_of_another_size_trains_the_rest_of_the_epoch_each_row_once(before: int, after: int) -> None:
    """An elastic group that lost (or gained) a node resumes a checkpoint within an epoch: the rows the old group
    had not reached are dealt to the new ranks, none skipped and none trained twice (only the order's own padding
    to a multiple of the ranks repeats a row, as DistributedSampler does)."""
    rows = TensorDataset(torch.arange(103))
    batch, step, epoch = 4, 5, 1
    trained: list[int] = []
    for rank in range(before):
        whole = train_loader_of(rows, batch, seed=3, rank=rank, world=before)
        whole.sampler.set_epoch(epoch)
        trained += [i for b in list(whole)[:step] for i in b[0].tolist()]
    assert len(trained) == step * batch * before
    rest: list[int] = []
    for rank in range(after):
        resumed = train_loader_of(rows, batch, seed=3, rank=rank, world=after)
        resumed.sampler.start_at(epoch, len(trained))
        rest += [i for b in resumed for i in b[0].tolist()]
    padding = len(rest) - (103 - len(trained))
    assert 0 <= padding < after
    counts = Counter(trained + rest)
    assert sorted(counts) == list(range(103))  # none skipped
    assert sum(counts.values()) - len(counts) == padding  # none twice but the padding


def test_each_epoch_is_shuffled_by_the_seed_alone() -> None:
    rows = TensorDataset(torch.arange(40))
    orders = []
    for seed in (3, 3, 4):
        loader: DataLoader = train_loader_of(rows, 8, seed=seed, rank=0, world=1)
        torch.manual_seed(len(orders))  # the global RNG differs each time: the order must not
        orders.append([b[0].tolist() for b in loader])
    assert orders[0] == orders[1] != orders[2]


@pytest.mark.parametrize(
    ("outstanding", "silent"),
    [
        ({}, []),
        ({0: 99.9, 1: 99.0}, []),  # answers due within the poll interval: busy, not silent
        ({1: 95.0}, [(1, 5.0)]),
        ({0: 60.0, 1: 90.0, 2: 99.5}, [(0, 40.0), (1, 10.0)]),  # the longest silent first
    ],
)
def test_a_rank_is_silent_once_its_poll_has_waited_five_seconds(
    outstanding: dict[int, float], silent: list[tuple[int, float]]
) -> None:
    assert silent_ranks(outstanding, now=100.0) == silent


@pytest.mark.parametrize(
    ("value", "higher_is_better", "score"),
    [
        (0.9, True, 0.9),
        (0.25, False, -0.25),  # lower is better: negated, so Ray Train keeps the highest
        (float("nan"), True, UNSCORED),  # a checkpoint within an epoch, or a diverged epoch: last
        (float("inf"), False, UNSCORED),
        (None, True, UNSCORED),
        (True, True, UNSCORED),
    ],
)
def test_checkpoints_rank_by_a_finite_score_whatever_their_metric_holds(
    value: object, higher_is_better: bool, score: float
) -> None:
    """Ray Train writes a NaN score to its record of the run as null and fails to read it back on a resume (a
    TypeError in its checkpoint manager): every checkpoint ranks by a finite number instead."""
    assert ranking_score(value, higher_is_better) == score
    assert math.isfinite(ranking_score(value, higher_is_better))
