"""The public API for your own training code: the one module of this project that your code imports.

Bring Ray Train's own training function, written only against Ray Train's API (``prepare_model``,
``prepare_data_loader`` or ``get_dataset_shard``, ``ray.train.report(metrics, checkpoint=...)``,
``ray.train.get_checkpoint()``), and add the two things Ray Train does not know: which reported metric says a
model is better (and in which direction), and how a checkpoint folder becomes a model to register::

    from raytrain_tasks.api import Metric, TrainFunc

    def train_func(config: dict) -> None:
        ...  # your Ray Train loop, unchanged

    def load_model(checkpoint_dir: Path, config: dict) -> torch.nn.Module:
        ...  # rebuild the model from what train_func saved

    training = TrainFunc(
        train_func,
        metric=Metric("val_loss", higher_is_better=False),
        load_model=load_model,
        input_example=lambda config: torch.zeros(2, 10),
    )

and run it with ``prefect-raytrain train --train-code my_package.train:training --train-config '{"hidden": 64}'``
(or the flow parameters ``train_code`` and ``train_config``). The pipeline then schedules, retries and resumes it,
logs every reported metric to MLflow at its step, keeps every checkpoint in the run's storage, and registers the
best checkpoint's model behind a promotion gate on your metric.

What stays the pipeline's (not extension points): where checkpoints are stored and how a run resumes (a restarted
worker group finds the last committed checkpoint through ``ray.train.get_checkpoint()``), the MLflow run, the
registry and its gate, retries. Your code never imports Prefect or MLflow.

This module is the stable surface; everything else in the project is internal and may change. It imports neither
torch nor Ray, so it is cheap to import anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from raytrain_tasks.code_rules import DATA_DIR_KEY, TRAIN_CONFIG_KEYS, check_code_config, spec_metric_problem

__all__ = [
    "DATA_DIR_KEY",
    "Metric",
    "MetricChoice",
    "Splits",
    "TrainFunc",
    "TrainSpec",
    "TRAIN_CONFIG_KEYS",
    "checkpoint_if_preempted",
]
# Keys of the config your code receives: TRAIN_CONFIG_KEYS are the pipeline's own settings (epochs, batch_size, lr,
# seed, num_workers, use_gpu); DATA_DIR_KEY holds the local folder of what ``prepare`` wrote.

Prepare = Callable[[dict[str, Any], Path], str | None]
ModelMetadata = Callable[[dict[str, Any]], Mapping[str, Any]]


@dataclass(frozen=True)
class Metric:
    """A metric your code reports with ``ray.train.report``: it picks the best checkpoint of a run and is what the
    promotion gate compares, ``higher_is_better`` deciding which way."""

    name: str
    higher_is_better: bool

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError("Metric(name=...) must be the non-empty name of a metric train_func reports")

    @property
    def order(self) -> str:
        """Ray Train's ``checkpoint_score_order`` for this metric."""
        return "max" if self.higher_is_better else "min"

    def better(self, candidate: float, than: float) -> bool:
        return candidate > than if self.higher_is_better else candidate < than


# ``metric=`` takes a Metric, or a function of ``config`` that returns one: a setting of your code then chooses it
# (``lambda config: Metric(config["select_by"], config["select_by"] != "val_loss")``). It is called once where the
# run starts, with the run's config; a resume keeps the same settings, so the same metric.
MetricChoice = Metric | Callable[[dict[str, Any]], Metric]


@dataclass(frozen=True, kw_only=True)
class CodeOptions:
    """What a ``TrainFunc`` and a ``TrainSpec`` both take, by keyword. Each is a function of ``config`` (the config
    your code receives) unless said otherwise. [Your code in detail](own-code.md#every-option) says more."""

    input_example: Callable[[dict[str, Any]], Any] | None = None
    """``input_example(config)``: an input the model accepts. MLflow exports the model with it."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Values for ``config`` where neither ``train_config`` nor the pipeline sets them."""
    settings: type | None = None
    """Your settings as a class (pydantic or a dataclass), instead of ``defaults``. ``train_config`` is checked
    against it before anything starts, and the Prefect form shows one field per setting."""
    prepare: Prepare | None = None
    """``prepare(config, folder)``: the prepare-data step. It writes your data into ``folder``; the pipeline stores
    it by content hash, and your code reads it from ``config["data_dir"]``."""
    artifacts: Callable[[Any, dict[str, Any], Path], None] | None = None
    """``artifacts(model, config, folder)``: files about the registered model, logged under ``evaluation/``."""
    model_metadata: ModelMetadata | None = None
    """``model_metadata(config) -> {key: JSON value}``: the registered model's MLflow metadata."""
    schema: ModelMetadata | None = None
    """``schema(config) -> {key: JSON value}``: what inputs and outputs mean. A champion of another schema is not
    compared."""
    model_name: Callable[[dict[str, Any]], str] | None = None
    """``model_name(config) -> str``: the registered model, where the ``model_name`` setting is left at its
    default."""

    def _check_options(self, kind: str) -> None:
        check_code_config(kind, self.defaults, self.settings, self.prepare)
        for name in ("input_example", "prepare", "artifacts", "model_metadata", "schema", "model_name"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{kind}({name}=...) must be a function, got {value!r}")


@dataclass(frozen=True)
class TrainFunc(CodeOptions):
    """Ray Train's training function, with what the pipeline needs beside it: the metric that decides, and how a
    checkpoint becomes a model to register."""

    train_func: Callable[[dict[str, Any]], None]
    """``train_func(config)``, run on every worker as ``TorchTrainer(train_func, ...)`` would run it."""
    metric: MetricChoice
    """The reported metric that picks the best checkpoint and that the gate compares, or a function of ``config``
    returning it."""
    _: KW_ONLY
    load_model: Callable[[Path, dict[str, Any]], Any] | None = None
    """``load_model(checkpoint_dir, config) -> torch.nn.Module``. None: nothing can be registered."""
    datasets: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
    """``datasets(config) -> {"train": ray.data.Dataset, ...}``, passed as ``TorchTrainer(datasets=...)``."""
    gate_metric: str = ""
    """The reported metric the gate compares, when it is not ``metric``; same direction."""
    evaluate: Callable[[Any, dict[str, Any]], Mapping[str, float]] | None = None
    """``evaluate(model, config) -> {metric: value}``: scores this run's model and the champion on today's data."""

    def __post_init__(self) -> None:
        if not callable(self.train_func):
            raise TypeError(f"TrainFunc(train_func=...) must be a function taking config, got {self.train_func!r}")
        if not isinstance(self.metric, Metric) and not callable(self.metric):
            raise TypeError(
                "TrainFunc(metric=...) must be a raytrain_tasks.api.Metric, e.g. Metric('val_loss', "
                f"higher_is_better=False), or a function of config returning one; got {self.metric!r}"
            )
        if (self.load_model is None) != (self.input_example is None):
            raise TypeError("TrainFunc needs load_model and input_example together (both, or neither)")
        self._check_options("TrainFunc")
        for name in ("evaluate", "artifacts", "model_metadata", "schema"):
            if getattr(self, name) is not None and self.load_model is None:
                raise TypeError(
                    f"TrainFunc({name}=...) works on registered models: it needs load_model and input_example"
                )
        for name in ("load_model", "datasets", "evaluate"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"TrainFunc({name}=...) must be a function, got {value!r}")

    @property
    def can_register(self) -> bool:
        return self.load_model is not None

    @property
    def selection(self) -> Metric:
        """The metric that picks the best checkpoint: ``metric``, once chosen for a run where it is a function."""
        if not isinstance(self.metric, Metric):
            raise TypeError("TrainFunc: metric is a function of config; the pipeline chooses it per run")
        return self.metric

    @property
    def gate(self) -> Metric:
        """The metric the promotion gate compares (``gate_metric``, else ``metric``), in ``metric``'s direction."""
        return Metric(self.gate_metric or self.selection.name, self.selection.higher_is_better)


@dataclass(frozen=True)
class Splits:
    """The data of a ``TrainSpec``, of one of two kinds:

    - map-style datasets (``torch.utils.data.Dataset``) whose items are ``(inputs, target)`` tensors: every worker
      builds them (``data(config)`` runs there) and reads its share through ``prepare_data_loader``;
    - Ray Datasets (``ray.data.Dataset``), for data too large for that: built on the driver and handed to
      ``TorchTrainer(datasets=...)``; each worker streams its shard of ``train`` (``get_dataset_shard``) and a
      share of the rows of ``val`` and ``test`` (splits you materialize are divided among a fixed number of
      workers once, on the driver). Each row holds the inputs and the target in the two columns named by
      ``columns``.

    ``test`` is held out: never trained on, never used to pick a checkpoint; the promotion gate compares its
    scores, so the pipeline needs it (Splits without it are refused before any worker starts: the fit calls
    ``data(config)`` once on the driver first)."""

    train: Any
    val: Any
    test: Any = None
    columns: tuple[str, str] = field(default=("inputs", "target"), kw_only=True)  # Ray Datasets: inputs', target's


@dataclass(frozen=True)
class TrainSpec(CodeOptions):
    """Your model, data, loss and metrics; the pipeline's own loop trains them: DDP, sharded data, a checkpoint
    every epoch, an exact resume, the held-out test split scored for the gate."""

    data: Callable[[dict[str, Any]], Splits]
    """``data(config) -> Splits``: the same splits every time it is called."""
    model: Callable[[dict[str, Any], Any], Any]
    """``model(config, example) -> torch.nn.Module``; ``example`` is an input batch."""
    loss: Callable[[Any, Any], Any]
    """``loss(outputs, targets) -> scalar tensor``, the mean over the batch."""
    metric: MetricChoice
    """Which measure decides: ``Metric("accuracy", True)``, ``Metric("loss", False)``, or a function of
    ``config`` returning one. ``val_<name>`` picks the best checkpoint; the gate compares ``test_<name>``."""
    _: KW_ONLY
    metrics: Callable[[Any, Any], Mapping[str, Any]] | None = None
    """``metrics(outputs, targets) -> {name: mean over the batch}``, reported as ``val_<name>``, ``test_<name>``."""
    optimizer: Callable[[Any, dict[str, Any]], Any] | None = None
    """``optimizer(parameters, config)``. Default: Adam with ``config["lr"]``."""

    def __post_init__(self) -> None:
        for name in ("data", "model", "loss"):
            if not callable(getattr(self, name)):
                raise TypeError(f"TrainSpec({name}=...) must be a function, got {getattr(self, name)!r}")
        if not isinstance(self.metric, Metric) and not callable(self.metric):
            raise TypeError(
                f"TrainSpec(metric=...) must be a raytrain_tasks.api.Metric or a function returning one, got "
                f"{self.metric!r}"
            )
        if isinstance(self.metric, Metric) and (problem := spec_metric_problem(self, self.metric)):
            raise TypeError(problem)
        self._check_options("TrainSpec")


def checkpoint_if_preempted(save: Callable[[], object]) -> bool:
    """For a ``train_func``: call it on every rank after each training step, with what reports a checkpoint within
    the epoch. When the worker group is about to lose a process, every rank calls ``save()`` at this same step:

    - after a SIGTERM to one of the group's workers (a spot node shutting down), it then raises, and Ray Train
      restarts the group from that checkpoint;
    - after Ray's notice that a node of the group is being drained, it returns True, and training goes on.

    It returns False when nothing was asked. On several workers it is a collective: one small all-reduce."""
    from raytrain_tasks.stop_requests import checkpoint_if_preempted as on_request

    return on_request(save)
