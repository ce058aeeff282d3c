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
from raytrain_tasks.tracking.names import DATASET_DIGEST_KEY, GLOBAL_STEP_KEY, IN_EPOCH_KEY, STEP_LOSS_KEY
from raytrain_tasks.tracking.outcome import SPEC_LOOP_EXTRAS, headline
from raytrain_tasks.trainspec import data as spec_data
from raytrain_tasks.trainspec.checkpoint import capture_rng_state, restore_rng_state, this_runs_staging_folder
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
from raytrain_tasks.trainspec.resume import checkpoint_dir_name
from raytrain_tasks.trainspec.steps import batch_sums, mean_of, score_split, train_epoch
from raytrain_tasks.trainspec.within_epoch import EpochSoFar, WithinEpoch
from raytrain_tasks.worker_log import configure_worker_logging

logger = logging.getLogger(__name__)
STATE_FILE = "spec_state.pt"
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

    def __call__(self, config: dict[str, Any]) -> None:
        self._run(config, self.ray_splits, self.step_checkpoints)

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


def _spec_loop(spec: TrainSpec) -> Callable[[dict[str, Any], RaySplits | None, StepCheckpoints], None]:
    def train_func(
        config: dict[str, Any], ray_splits: RaySplits | None = None, steps: StepCheckpoints = AT_EPOCH_ENDS
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
            else ray.train.torch.prepare_data_loader(train_loader_of(splits.train, batch_size, seed, rank, world))
        )
        model = ray.train.torch.prepare_model(spec.model(config, facts.example))
        optimizer = (
            spec.optimizer(model.parameters(), config)
            if spec.optimizer is not None
            else torch.optim.Adam(model.parameters(), lr=float(config["lr"]))
        )
        if splits is not None:  # a typo in the metric's name, found on one batch before any training (all else: below)
            val_batches = slice_batches(splits.val, rank, world, batch_size)
            names = _batch_metric_names(spec, model, val_batches, ray.train.torch.get_device())
            check_metric_named(spec, config, names, typos_only=True)
        resumed = _resume(model, optimizer, digest)
        start, taken = resumed.epoch, _run_folders()
        steps_in_epoch = len(train_loader) if train_loader is not None else None
        global_step = resumed.global_step(steps_in_epoch)
        selection = f"val_{_chosen(spec, config).name}"
        for epoch in range(start, int(config["epochs"])):
            started = time.perf_counter()
            sampler = getattr(train_loader, "sampler", None)
            if isinstance(sampler, DistributedSampler):
                sampler.set_epoch(epoch)
            part = resumed.in_epoch if epoch == start else None
            if part is not None and isinstance(sampler, ResumableSampler):
                sampler.start_at(epoch, part.steps * batch_size)

            def commit(metrics: dict[str, Any], so_far: EpochSoFar, epoch: int = epoch) -> None:
                step = int(metrics[GLOBAL_STEP_KEY])
                name = checkpoint_dir_name(epoch, taken, global_step=step)
                state = {"in_epoch": so_far, "global_step": step}
                _report({**metrics, selection: math.nan}, model, optimizer, digest, name, state)
                if rank == 0:
                    logger.info(step_line(epoch, int(config["epochs"]), metrics))

            within = WithinEpoch(steps, epoch, global_step, steps_in_epoch, commit, part)
            model.train()
            batches = ray_train_batches(facts, batch_size, seed, epoch, rank) if splits is None else train_loader
            after_step = within if steps.on else None
            total, count = train_epoch(spec, model, optimizer, batches, after_step, within.start if part else None)
            global_step = within.global_step if steps.on else global_step + (steps_in_epoch or 0)
            extra = within.at_epoch_end(total, count) if steps.on else {}
            metrics: dict[str, Any] = {}
            for name in ("val", "test"):
                held_out = (
                    ray_held_out_batches(facts, name, batch_size, rank, world)
                    if splits is None
                    else slice_batches(getattr(splits, name), rank, world, batch_size)
                )
                metrics |= score_split(spec, model, held_out, name)
            if epoch == start:
                check_metric_named(spec, config, [key.removeprefix("val_") for key in metrics if key[:4] == "val_"])
            # An epoch resumed part-way counts its earlier attempt's seconds too.
            before = part.seconds if part is not None else 0.0
            figures = epoch_figures(total, count, started - before, ray.train.torch.get_device())
            metrics = {"epoch": epoch, **figures, **metrics, **extra}
            if spec.prepare is None and digest:  # with prepare, the run's dataset hash is the stored version's
                metrics[DATASET_DIGEST_KEY] = digest  # the controller records it as the run's dataset hash
            reporting = time.perf_counter()
            _report(metrics, model, optimizer, digest, checkpoint_dir_name(epoch, taken), {"global_step": global_step})
            if rank == 0:  # a Ray Job's log (its only progress) and --verbose show it
                logger.info(epoch_line(epoch, int(config["epochs"]), metrics, time.perf_counter() - reporting))

    return train_func


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


def _batch_metric_names(spec: TrainSpec, model: Any, val_batches: Any, device: Any) -> list[str] | None:
    """The names ``loss`` and ``metrics`` give on this rank's first validation batch (``val_batches``: its slice;
    None when it has none), from the model as built: no training, and no random number drawn (a DataLoader's
    iterator draws one), so the trajectory stays the uninterrupted one's."""
    net = getattr(model, "module", model)  # not DDP's forward: no collective for a check some ranks may skip
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        batch = next(iter(val_batches), None)
        if batch is None:
            return None
        was_training = net.training
        net.eval()
        try:
            sums, _ = batch_sums(spec, net, [batch], device)
        finally:
            net.train(was_training)
    return sorted(sums)


def check_metric_named(
    spec: TrainSpec, config: dict[str, Any], names: list[str] | None, typos_only: bool = False
) -> None:
    """UserCodeError (not retried) when the spec's metric for this run is not one its ``loss``/``metrics`` give:
    found at the first epoch, not after the last one, where no checkpoint could be picked. ``typos_only``: only
    when one of ``names`` is close to it (names from one batch: a metric may leave a key out of a batch of one
    class, and is judged on the whole split after the first epoch's validation)."""
    if names is None:
        return
    chosen = spec.metric if isinstance(spec.metric, Metric) else spec.metric(config)
    if chosen.name in names:
        return
    import difflib

    lowered = {name.lower(): name for name in names}
    close = [lowered[chosen.name.lower()]] if chosen.name.lower() in lowered else []
    close = close or difflib.get_close_matches(chosen.name, names, n=1)
    if typos_only and not close:
        return
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UserCodeError(
        f"TrainSpec(metric={chosen.name!r}) names no metric this spec computes: its loss and metrics=... give "
        f"{names}{hint}. val_<metric> picks the best checkpoint and test_<metric> is what the gate compares: name "
        "one of those (or 'loss'), or return it from metrics=..."
    )


def _run_folders() -> frozenset[str]:
    """The folders in this run's storage as the worker group starts, which a checkpoint of this attempt must not be
    named as. (Ray Train takes rank 0's ``checkpoint_dir_name`` for all ranks; every rank computes it alike.)"""
    import ray.train

    storage = ray.train.get_context().get_storage()
    found = storage.storage_filesystem.get_file_info(
        pafs.FileSelector(storage.experiment_fs_path, allow_not_found=True)
    )
    return frozenset(info.base_name for info in found if info.type == pafs.FileType.Directory)


def _chosen(spec: TrainSpec, config: dict[str, Any]) -> Metric:
    return spec.metric if isinstance(spec.metric, Metric) else spec.metric(config)


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


def _report(
    metrics: dict[str, Any], model: Any, optimizer: Any, digest: str, folder_name: str, extra: dict[str, Any]
) -> None:
    """``metrics`` and (rank 0 alone writes it) a checkpoint in folder ``folder_name``: model, optimizer, RNG, the
    epoch it holds, and ``extra`` (the global step; how far an epoch got, for one taken within it)."""
    import ray.train

    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=folder_name)
        return
    # Written where the run's next checkpoint on this node removes what a killed attempt left (a worker killed
    # while it writes or uploads cannot remove its folder).
    with this_runs_staging_folder() as folder:
        state = {
            "model": {k: v.detach().cpu() for k, v in getattr(model, "module", model).state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "rng": capture_rng_state(),  # torch, numpy and Python's: user code draws from any of them
            "epoch": metrics.get("epoch", metrics.get(IN_EPOCH_KEY)),
            "data_sha256": digest,
            **{key: value.as_state() if isinstance(value, EpochSoFar) else value for key, value in extra.items()},
        }
        torch.save(state, folder / STATE_FILE)
        checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=folder_name)


@dataclass(frozen=True)
class Resumed:
    """Where a worker group starts: at epoch ``epoch`` (0-based), part-way through it when ``in_epoch`` says how
    far a checkpoint within it got."""

    epoch: int = 0
    in_epoch: EpochSoFar | None = None
    step: int | None = None  # the global step the checkpoint holds; None: an earlier release's, which had none

    def global_step(self, steps_in_epoch: int | None) -> int:
        if self.step is not None:
            return self.step
        return self.epoch * (steps_in_epoch or 0)


def _resume(model: Any, optimizer: Any, digest: str) -> Resumed:
    """Where to start: epoch 0, the one after the last committed epoch checkpoint, or the step after a checkpoint
    within an epoch (model, optimizer, RNG restored: rank 0's, on every rank, as every rank was seeded alike and
    draws alike)."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return Resumed()
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=True)
    # "" on either side: the data is pinned by prepare's stored version (an older release hashed it here too).
    if state["data_sha256"] and digest and state["data_sha256"] != digest:
        raise DataRefusedError(
            f"the data changed since this run's last checkpoint (content hash {state['data_sha256'][:12]}... then, "
            f"{digest[:12]}... now): a resume continues on the data it started with. Start a new run instead"
        )
    getattr(model, "module", model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if isinstance(state["rng"], torch.Tensor):  # a checkpoint of an earlier release: torch's state alone
        torch.set_rng_state(state["rng"])
    else:
        restore_rng_state(state["rng"])
    step = int(state["global_step"]) if "global_step" in state else None
    if "in_epoch" in state:
        return Resumed(int(state["epoch"]), EpochSoFar.from_state(state["in_epoch"]), step)
    return Resumed(int(state["epoch"]) + 1, None, step)


def seed_as_workers(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
