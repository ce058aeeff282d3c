"""The pipeline's own training loop for a ``TrainSpec`` (raytrain_tasks.api): the user's model, data, loss and
metrics, trained the way Ray Train's guide trains them, as a plain ``train_func``.

Each epoch: train on this worker's shard (``prepare_data_loader``'s DistributedSampler, reshuffled per epoch; or
``get_dataset_shard("train")`` of Ray Dataset splits, shuffled locally), score the validation and test splits on
disjoint, unpadded slices whose sums are all-reduced (exact figures over each whole split), then one
``ray.train.report`` with a checkpoint from rank 0: model, optimizer, RNG state, epoch and the data's content hash
(none with ``prepare``, whose stored version's hash pins the data before any worker starts), in a folder named for
its epoch (``epoch-0003``; ``epoch-0003-r1`` when an earlier attempt's folder has that name). A resume restores
all of it: on torch datasets it follows the uninterrupted trajectory (on Ray Datasets, Ray Data decides which rows
reach which shard); a resume on other data is refused (Ray Datasets are pinned only by ``prepare``'s version).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch
from torch.utils.data import DistributedSampler

from raytrain_tasks.api import Metric, Splits, TrainFunc, TrainSpec
from raytrain_tasks.errors import DataRefusedError, DatasetError, UserCodeError, user_frames
from raytrain_tasks.long_runs import StepCheckpoints
from raytrain_tasks.stop_requests import StopRequests
from raytrain_tasks.tracking.names import DATASET_DIGEST_KEY, GLOBAL_STEP_KEY, STEP_LOSS_KEY
from raytrain_tasks.tracking.outcome import SPEC_LOOP_EXTRAS, headline
from raytrain_tasks.trainspec import data as spec_data
from raytrain_tasks.trainspec.checkpoint import STATE_FILE, Resumed, report_state, resume_state
from raytrain_tasks.trainspec.data import (
    RaySplits,
    ResumableSampler,
    check_ray_splits,
    data_digest,
    driver_batches,
    epoch_figures,
    is_materialized,
    is_ray_dataset,
    quiet_ray_data,
    ray_held_out_batches,
    ray_train_batches,
    slice_batches,
    train_loader_of,
    trainer_datasets,
    uses_ray_data,
)
from raytrain_tasks.trainspec.metric_names import batch_metric_names, check_metric_named, chosen_metric
from raytrain_tasks.trainspec.resume import checkpoint_dir_name
from raytrain_tasks.trainspec.steps import batch_sums, mean_of, score_split, train_epoch
from raytrain_tasks.trainspec.within_epoch import EpochSoFar, WithinEpoch
from raytrain_tasks.worker_log import configure_worker_logging

logger = logging.getLogger(__name__)
AT_EPOCH_ENDS = StepCheckpoints()
EXAMPLE_ROWS = 2


def as_train_func(spec: TrainSpec, metric: Metric | None = None) -> TrainFunc:
    """The spec as Ray Train's training function, with its gate, model loader and input example. ``metric``: the
    one the spec's chooses for a run (``raytrain_tasks.user_code.bind``), when the spec's is a function of config;
    until then the TrainFunc's is that function."""
    chosen = spec.metric if isinstance(spec.metric, Metric) else metric
    return TrainFunc(
        spec_train_func(spec),
        metric=spec.metric if chosen is None else Metric(f"val_{chosen.name}", chosen.higher_is_better),
        load_model=spec_load_model(spec),
        input_example=spec_input_example(spec),
        defaults=spec.defaults,
        gate_metric="" if chosen is None else f"test_{chosen.name}",
        evaluate=spec_evaluate(spec),
        prepare=spec.prepare,
        settings=spec.settings,
        artifacts=spec.artifacts,
        model_metadata=spec.model_metadata,
        schema=spec.schema,
        model_name=spec.model_name,
    )


class SpecTrainFunc:
    """A spec's ``train_func`` (``TrainFunc.train_func`` of a ``TrainSpec``); the driver also checks its data."""

    def __init__(self, spec: TrainSpec) -> None:
        self.spec = spec
        self._run = _spec_loop(spec)
        self.ray_data = False  # what check_data found
        self.train_rows: int | None = None  # ... the train split's rows, where known without reading it
        self.kept = False  # ... and whether the splits are all kept in the object store (materialized)
        self._checked: tuple[dict[str, Any], Splits] | None = None  # its splits, for trainer_data
        self.ray_splits: RaySplits | None = None  # set by trainer_data on the driver, by run_train_func on workers
        self.step_checkpoints = AT_EPOCH_ENDS  # the run's checkpoints within epochs, set by run_train_func
        self.driver_stop: Any = None  # ... and the driver's DriverStop actor (raytrain_tasks.stop_requests)

    def __call__(self, config: dict[str, Any]) -> None:
        self._run(config, self.ray_splits, self.step_checkpoints, self.driver_stop)

    def check_data(self, config: dict[str, Any]) -> bool:
        """``data(config)`` once, here (with Ray connected: it may build Ray Datasets), and whether it gives Ray
        Datasets. Splits of the wrong kind, an empty split, no test split or a missing column are refused in
        seconds on the driver, not by every worker once it has started; an error in ``data`` is the user's."""
        quiet_ray_data()
        try:
            splits = _splits(self.spec, config)
        except (UserCodeError, DatasetError):
            raise
        except Exception as exc:  # the user's data(): named with its frames, not retried (test_own_code)
            raise UserCodeError(f"TrainSpec.data failed on the driver: {user_frames(exc)}") from exc
        self.ray_data = uses_ray_data(splits)
        self.train_rows = _rows_known(splits.train)
        if self.ray_data:
            check_ray_splits(splits)
            self._checked = (config, splits)
            self.kept = all(is_materialized(getattr(splits, name)) for name in ("train", "val", "test"))
        return self.ray_data

    def trainer_data(self, config: dict[str, Any], world_size: int = 0) -> dict[str, Any]:
        """``TorchTrainer``'s ``datasets=``/``dataset_config=`` for Ray Dataset splits, built here; none for torch
        Datasets, which every worker builds (known from ``check_data``, called first on this object).
        ``world_size``: the worker group's size when it is fixed (0: elastic), to divide kept splits among."""
        self.ray_splits = None
        if not self.ray_data:
            return {}
        quiet_ray_data()
        checked, self._checked = self._checked, None
        splits = checked[1] if checked is not None and checked[0] == config else _splits(self.spec, config)
        data, divided = trainer_datasets(splits, world_size)
        self.ray_splits = RaySplits(splits.columns, example_inputs(splits), divided, world_size)
        return data


def spec_train_func(spec: TrainSpec) -> Callable[[dict[str, Any]], None]:
    return SpecTrainFunc(spec)


def _spec_loop(spec: TrainSpec) -> Callable[[dict[str, Any], RaySplits | None, StepCheckpoints, Any], None]:
    def train_func(
        config: dict[str, Any],
        ray_splits: RaySplits | None = None,
        steps: StepCheckpoints = AT_EPOCH_ENDS,
        driver_stop: Any = None,
    ) -> None:
        import ray.train.torch

        configure_worker_logging()
        seed_as_workers(int(config["seed"]))
        splits, facts = _worker_splits(spec, config, ray_splits)
        # With prepare, the data is pinned by its stored version's content hash, checked before any worker starts
        # (a resume on other data is refused there): no pass over the data here. Nor for Ray Datasets (pinned by
        # prepare's stored version alone: hashing them would read them whole).
        digest = "" if splits is None or spec.prepare is not None else data_digest(splits)
        context = ray.train.get_context()
        rank, world = context.get_world_rank(), context.get_world_size()
        batch_size, seed = int(config["batch_size"]), int(config["seed"])
        train_loader = (
            None
            if splits is None
            # Not moved to the device by Ray's wrapper, which loads the next batch before this one is trained: the
            # RNG state a checkpoint takes after a step would hold that batch's draws (random augmentations).
            else ray.train.torch.prepare_data_loader(
                train_loader_of(splits.train, batch_size, seed, rank, world), move_to_device=False
            )
        )
        model = ray.train.torch.prepare_model(spec.model(config, facts.example))
        optimizer = (
            spec.optimizer(model.parameters(), config)
            if spec.optimizer is not None
            else torch.optim.Adam(model.parameters(), lr=float(config["lr"]))
        )
        if splits is not None:  # a typo in the metric's name, found on one batch before any training (all else: below)
            val_batches = slice_batches(splits.val, rank, world, batch_size)
            names = batch_metric_names(spec, model, val_batches, ray.train.torch.get_device())
            check_metric_named(spec, config, names, typos_only=True)
        run = WorkerRun(spec, config, splits, facts, digest, rank, world, train_loader, model, optimizer)
        resumed = resume_state(model, optimizer, digest)
        run.train(resumed, steps, StopRequests(driver_stop, rank))

    return train_func


@dataclass
class WorkerRun:
    """One worker's training run of a spec, from where a checkpoint left it (or the start) to the last epoch."""

    spec: TrainSpec
    config: dict[str, Any]
    splits: Splits | None  # torch Datasets; None for Ray Datasets, whose shards Ray Train hands out
    facts: RaySplits
    digest: str
    rank: int
    world: int
    train_loader: Any
    model: Any
    optimizer: Any

    def train(self, resumed: Resumed, steps: StepCheckpoints, stops: StopRequests) -> None:
        self.taken = _run_folders()
        self.selection = f"val_{chosen_metric(self.spec, self.config).name}"
        self.steps_in_epoch = len(self.train_loader) if self.train_loader is not None else None
        global_step = resumed.global_step(self.steps_in_epoch)
        for epoch in range(resumed.epoch, int(self.config["epochs"])):
            part = resumed.in_epoch if epoch == resumed.epoch else None
            if part is not None and part.world != self.world:  # each row of the epoch is still trained once
                said = f"taken by {part.world} workers goes on with {self.world}: the rows left are dealt anew"
                logger.warning("the checkpoint within epoch %d %s", epoch + 1, said)
            # A Ray Dataset shard cannot start again where it stopped (ray#37633): no checkpoint within its epochs.
            within_ok = self.splits is not None
            commit = self._commit_within(epoch)
            within = WithinEpoch(steps, epoch, global_step, self.steps_in_epoch, commit, part, stops, within_ok)
            self._epoch(epoch, within, part, first=epoch == resumed.epoch)
            global_step = within.global_step
            within.after_epoch_commit(final=epoch == int(self.config["epochs"]) - 1)

    def _epoch(self, epoch: int, within: WithinEpoch, part: EpochSoFar | None, first: bool) -> None:
        """Train ``epoch`` (on from ``part`` of it), score the held-out splits, commit its checkpoint."""
        import ray.train.torch

        started = time.perf_counter()
        batch_size, seed = int(self.config["batch_size"]), int(self.config["seed"])
        sampler = getattr(self.train_loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        if part is not None and isinstance(sampler, ResumableSampler):
            sampler.start_at(epoch, part.rows)  # the rows every rank trained, the epoch's order consumed
            within.steps_in_epoch = part.steps + len(self.train_loader)
        self.model.train()
        batches = (
            ray_train_batches(self.facts, batch_size, seed, epoch, self.rank)
            if self.splits is None
            else self.train_loader
        )
        total, count = train_epoch(
            self.spec, self.model, self.optimizer, batches, within, within.start if part else None
        )
        metrics: dict[str, Any] = {}
        for name in ("val", "test"):
            metrics |= score_split(self.spec, self.model, self._held_out(name, batch_size), name)
        if first:
            names = [key.removeprefix("val_") for key in metrics if key[:4] == "val_"]
            check_metric_named(self.spec, self.config, names)
        # An epoch resumed part-way counts its earlier attempt's seconds too.
        before = part.seconds if part is not None else 0.0
        figures = epoch_figures(total, count, started - before, ray.train.torch.get_device())
        extra = within.at_epoch_end()
        metrics = {"epoch": epoch, **figures, **metrics, **extra}
        if self.spec.prepare is None and self.digest:  # with prepare, the run's dataset hash is the stored version's
            metrics[DATASET_DIGEST_KEY] = self.digest  # the controller records it as the run's dataset hash
        reporting = time.perf_counter()
        name = checkpoint_dir_name(epoch, self.taken)
        report_state(metrics, self.model, self.optimizer, self.digest, name, {"global_step": within.global_step})
        if self.rank == 0:  # a Ray Job's log (its only progress) and --verbose show it
            logger.info(epoch_line(epoch, int(self.config["epochs"]), metrics, time.perf_counter() - reporting))

    def _held_out(self, name: str, batch_size: int) -> Any:
        if self.splits is None:
            return ray_held_out_batches(self.facts, name, batch_size, self.rank, self.world)
        return slice_batches(getattr(self.splits, name), self.rank, self.world, batch_size)

    def _commit_within(self, epoch: int) -> Callable[[dict[str, Any], EpochSoFar], None]:
        """How ``WithinEpoch`` commits a checkpoint within ``epoch``: no epoch scores (the metric NaN, ranked last)."""

        def commit(metrics: dict[str, Any], so_far: EpochSoFar) -> None:
            step = int(metrics[GLOBAL_STEP_KEY])
            name = checkpoint_dir_name(epoch, self.taken, global_step=step)
            state = {"in_epoch": so_far, "global_step": step}
            report_state({**metrics, self.selection: math.nan}, self.model, self.optimizer, self.digest, name, state)
            if self.rank == 0:
                logger.info(step_line(epoch, int(self.config["epochs"]), metrics))

        return commit


def spec_load_model(spec: TrainSpec) -> Callable[[Path, dict[str, Any]], Any]:
    def load_model(checkpoint_dir: Path, config: dict[str, Any]) -> Any:
        state = torch.load(checkpoint_dir / STATE_FILE, map_location="cpu", weights_only=True)
        model = spec.model(config, example_inputs(_splits(spec, config)))
        model.load_state_dict(state["model"])
        return model

    return load_model


def spec_input_example(spec: TrainSpec) -> Callable[[dict[str, Any]], Any]:
    def input_example(config: dict[str, Any]) -> Any:
        if spec.input_example is not None:
            return spec.input_example(config)
        return example_inputs(_splits(spec, config))

    return input_example


def spec_evaluate(spec: TrainSpec) -> Callable[[Any, dict[str, Any]], dict[str, float]]:
    def evaluate(model: Any, config: dict[str, Any]) -> dict[str, float]:
        """``test_loss`` and ``test_<metric>`` of ``model`` over the whole test split, here (no Ray Train)."""
        splits = _splits(spec, config)
        with torch.no_grad():
            batches = driver_batches(splits, "test", int(config["batch_size"]))
            sums, count = batch_sums(spec, model, batches, torch.device("cpu"))
        return mean_of({f"test_{key}": (total, count) for key, total in sums.items()})

    return evaluate


def example_inputs(splits: Splits) -> Any:
    """A batch of the first train inputs: what builds the model (shapes) and, by default, the exported example."""
    return spec_data.example_inputs(splits, EXAMPLE_ROWS)


def _worker_splits(spec: TrainSpec, config: dict[str, Any], given: RaySplits | None) -> tuple[Splits | None, RaySplits]:
    """A worker's torch Dataset splits (None for Ray Datasets, whose shards Ray Train hands it) and their columns
    and example. Those of Ray Datasets come from the driver (``trainer_data``): no worker calls ``data()`` for them."""
    if given is not None:
        return None, given
    splits = _splits(spec, config)
    if uses_ray_data(splits):
        raise DataRefusedError("TrainSpec.data gave Ray Datasets on a worker, torch Datasets on the driver: one kind")
    return splits, RaySplits(splits.columns, example_inputs(splits))


def _splits(spec: TrainSpec, config: dict[str, Any]) -> Splits:
    splits = spec.data(config)
    if not isinstance(splits, Splits):
        raise UserCodeError(f"TrainSpec.data must return raytrain_tasks.api.Splits, got {type(splits).__name__}")
    for name in ("train", "val"):
        if _empty(getattr(splits, name)):
            raise DataRefusedError(f"TrainSpec.data returned an empty {name} split")
    if _empty(splits.test):
        # Found before the workers start (check_data), not after the last epoch: the gate metric would never be
        # reported.
        name = spec.metric.name if isinstance(spec.metric, Metric) else "<metric>"
        raise UserCodeError(
            f"TrainSpec.data returned Splits without a test split: the best checkpoint is picked by "
            f"val_{name} and the promotion gate compares test_{name}, scored on rows the run "
            "never trains on nor picks a checkpoint by; return Splits(train, val, test) (e.g. 10-20% of the rows "
            "held out)"
        )
    uses_ray_data(splits)  # one kind for all three
    return splits


def _rows_known(dataset: Any) -> int | None:
    """A split's rows where counting reads nothing: a map-style Dataset's length, a materialized Ray Dataset's."""
    if is_ray_dataset(dataset):
        return int(dataset.count()) if is_materialized(dataset) else None
    return len(dataset) if hasattr(dataset, "__len__") else None


def _empty(dataset: Any) -> bool:
    """No split, or a map-style one of no items (a Ray Dataset is not counted: that would read it whole)."""
    return dataset is None or (not is_ray_dataset(dataset) and len(dataset) == 0)


def _run_folders() -> frozenset[str]:
    """The folders in this run's storage as the worker group starts, which a checkpoint of this attempt must not be
    named as. (Ray Train takes rank 0's ``checkpoint_dir_name`` for all ranks; every rank computes it alike.)"""
    import ray.train

    storage = ray.train.get_context().get_storage()
    found = storage.storage_filesystem.get_file_info(
        pafs.FileSelector(storage.experiment_fs_path, allow_not_found=True)
    )
    return frozenset(info.base_name for info in found if info.type == pafs.FileType.Directory)


def step_line(epoch: int, epochs: int, metrics: dict[str, Any]) -> str:
    """``epoch 2/3 step 150 train_loss=0.2782 (checkpoint)``: a checkpoint committed within an epoch."""
    loss = float(metrics[STEP_LOSS_KEY])
    return f"epoch {epoch + 1}/{epochs} step {int(metrics[GLOBAL_STEP_KEY])} train_loss={loss:.4f} (checkpoint)"


def epoch_line(epoch: int, epochs: int, metrics: dict[str, Any], checkpoint_s: float) -> str:
    """``epoch 2/3 train_loss=0.2782 val_loss=0.1834 val_accuracy=0.9527 (0.09 s, 13537 samples/s; checkpoint
    0.012 s)``: the losses and validation figures of a committed epoch (its number counted from 1), its seconds and
    speed, and the seconds its checkpoint took to save, upload and report (``checkpoint_s``)."""
    shown = " ".join(
        f"{name}={float(metrics[name]):.4f}"
        for name in headline(metrics, (*SPEC_LOOP_EXTRAS, "epoch", DATASET_DIGEST_KEY, GLOBAL_STEP_KEY, STEP_LOSS_KEY))
    )
    speed = f"{metrics['epoch_seconds']:.2f} s, {metrics['samples_per_second']:.0f} samples/s"
    speed += f"; checkpoint {checkpoint_s:.3f} s"
    return f"epoch {epoch + 1}/{epochs} {shown} ({speed})"


def seed_as_workers(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
