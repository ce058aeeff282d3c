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

import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_tasks.errors import PIPELINE_KEY_ALIASES

__all__ = ["DATA_DIR_KEY", "Metric", "MetricChoice", "Splits", "TrainFunc", "TrainSpec", "TRAIN_CONFIG_KEYS"]

# What ``settings=`` may be: a pydantic model class, or a dataclass; its fields are your code's settings.
SETTINGS_KINDS = "a pydantic BaseModel subclass or a dataclass"


def train_config_param_problem(key: str) -> str:
    """ "" when ``train_config.<key>`` can be an MLflow param name (the run logs every setting as one before it
    trains); else why not."""
    param = f"train_config.{key}"
    if re.fullmatch(r"[\w\-. /]{1,200}", key) and posixpath.normpath(param) == param:
        return ""
    return f"{key!r} cannot be the MLflow param {param!r}: use up to 200 letters, digits, _ - . / or spaces"


def pipeline_keys_refused(keys: Any, where: str) -> str:
    """ "" when ``keys`` set none of ``TRAIN_CONFIG_KEYS`` nor their usual other names (``PIPELINE_KEY_ALIASES``);
    else why ``where`` may not set them."""
    taken = [key for key in TRAIN_CONFIG_KEYS if key in keys]
    aliases = [key for key in PIPELINE_KEY_ALIASES if key in keys]
    if not taken and not aliases:
        return ""

    def flag(key: str) -> str:
        return "--" + PIPELINE_SETTING.get(key, key).replace("_", "-")

    reasons = []
    if taken:
        reasons.append(
            f"{where} may not set {', '.join(taken)}: your code gets the pipeline's own value ("
            + "; ".join(f"{key} from the setting `{PIPELINE_SETTING.get(key, key)}` ({flag(key)})" for key in taken)
            + "), so that the run's MLflow params, its progress and a resume agree with what trained; set the "
            "setting instead"
        )
    if aliases:
        targets = sorted({PIPELINE_KEY_ALIASES[key] for key in aliases})
        reasons.append(
            f"{where} sets {', '.join(aliases)}, another name of the pipeline's own "
            + " and ".join(f"config[{key!r}] (set with {flag(key)})" for key in targets)
            + f": code reading {', '.join(aliases)} would not follow the run's settings, nor would its progress, "
            "params and resume; set the setting, and read the pipeline's key"
        )
    return ". ".join(reasons)


# The keys the pipeline puts into the ``config`` your ``train_func`` receives, from its own settings (the setting
# each comes from beside it); the keys of ``train_config`` are added beside them. A resume hands the same values
# again. Neither ``train_config`` nor ``defaults`` may set them: set the pipeline's setting instead.
TRAIN_CONFIG_KEYS = ("epochs", "batch_size", "lr", "seed", "num_workers", "use_gpu")
PIPELINE_SETTING = {"lr": "learning_rate"}  # where a key's name differs from its setting's
# The key of ``config`` that holds the local folder of the run's prepared data, for code with ``prepare=...``: a
# ``str`` path, on the driver and on every worker (None while ``prepare`` itself runs). Such code may not set it
# in ``defaults`` or ``train_config``; code without ``prepare`` may use the key as its own.
DATA_DIR_KEY = "data_dir"


def data_dir_refused(keys: Any, where: str) -> str:
    """ "" unless ``keys`` (of code with ``prepare``) set ``DATA_DIR_KEY``; else why ``where`` may not."""
    if DATA_DIR_KEY not in keys:
        return ""
    return (
        f"{where} may not set {DATA_DIR_KEY!r}: with prepare=..., the pipeline puts the local folder of what prepare "
        f"wrote there; name your own setting otherwise (e.g. 'source_dir')"
    )


Prepare = Callable[[dict[str, Any], Path], str | None]
ModelMetadata = Callable[[dict[str, Any]], Mapping[str, Any]]
# Keys of the registered model's MLflow metadata that the pipeline sets; ``model_metadata`` may not.
PIPELINE_METADATA = ("run_key", "train_code", "dataset_hash")


def check_code_config(kind: str, defaults: Mapping[str, Any], settings: Any, prepare: Any) -> None:
    """What ``TrainFunc`` and ``TrainSpec`` refuse alike in ``defaults`` and ``settings``: TypeError, naming it."""
    if settings is not None:
        if defaults:
            raise TypeError(
                f"{kind} takes defaults=... or settings=..., not both: give each setting its default in the "
                "settings class"
            )
        if not isinstance(settings, type):
            raise TypeError(f"{kind}(settings=...) must be a class ({SETTINGS_KINDS}), got {settings!r}")
        from raytrain_tasks.code_settings import setting_names

        names = setting_names(settings, f"{kind}(settings={settings.__name__})")
        where = f"{kind}(settings={settings.__name__})"
    else:
        names, where = list(defaults), f"{kind}(defaults=...)"
    if refused := pipeline_keys_refused(names, where):
        raise TypeError(refused)
    for name in names:  # the run logs each setting as an MLflow param before it trains
        if problem := train_config_param_problem(str(name)):
            raise TypeError(f"{where}: the setting {problem}")
    if prepare is not None and (refused := data_dir_refused(names, where)):
        raise TypeError(refused)


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


@dataclass(frozen=True)
class TrainFunc:
    """Ray Train's training function, with what the pipeline needs beside it.

    Attributes:
        train_func: ``train_func(config)``, run on every worker as ``TorchTrainer(train_func, ...)`` would. It
            reports with ``ray.train.report(metrics, checkpoint=...)`` (every rank calls it each time; rank 0 alone,
            or every rank, may pass a checkpoint folder: the files of every rank are kept together) and resumes from
            ``ray.train.get_checkpoint()``. Include ``"epoch"`` (0-based) in the metrics to have MLflow steps
            follow your epochs; otherwise each checkpointed report is the next step.
        metric: the reported metric that picks the best checkpoint and that the promotion gate compares; or a
            function of ``config`` returning it, to let one of your settings choose (``MetricChoice``).
        load_model: ``load_model(checkpoint_dir, config) -> torch.nn.Module``: the servable model from a local copy
            of one of your checkpoints (for a sharded checkpoint, gather it here, e.g. with
            ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``). None: nothing can be registered,
            run with ``register=False``.
        input_example: ``input_example(config)`` -> a tensor (or numpy array) the model accepts: MLflow exports the
            model with it and records its signature. Needed with ``load_model``.
        datasets: ``datasets(config) -> {"train": ray.data.Dataset, ...}``, built on the driver and passed as
            ``TorchTrainer(datasets=...)``, for a ``train_func`` that reads ``ray.train.get_dataset_shard(name)``.
        defaults: values for ``config`` that apply when neither ``train_config`` nor the pipeline sets them.
        settings: your code's own settings, declared as a class (a pydantic ``BaseModel`` or a dataclass: one
            field per setting, with its type and default), instead of ``defaults``. ``train_config`` is then checked
            against it before anything starts (a key it does not declare, a value of the wrong type or a required
            setting left out is refused, naming ``train_config.<key>``); your code receives every setting in
            ``config`` as a plain JSON value (``Settings(**config)`` reads them back typed), each is logged as the
            MLflow param ``train_config.<key>``, and a served deployment that names your code shows one typed field
            per setting in the Prefect UI's run form.
        gate_metric: the reported metric the promotion gate compares, when it is not ``metric`` (e.g. select the
            best checkpoint by ``val_loss``, compare ``test_loss`` with the champion's); same direction.
        evaluate: ``evaluate(model, config) -> {metric: value}``: scores a servable model on the data your code
            holds out today, returning at least the gate's metric. It gets this run's model and the current
            champion, each loaded back from the registry as a torch module, so the gate compares the two on the
            same data (a champion trained on last month's data is judged on today's). None: the gate compares the
            scores recorded when each was trained, which is like with like only while the data does not change. A
            ``TrainSpec`` has one: its test split, loss and metrics.
        artifacts: ``artifacts(model, config, folder)``: files about the registered model (plots, a confusion
            matrix, per-class scores, a report...), written into ``folder`` (an empty local directory) on the driver
            when the run registers, with the model ``load_model`` gives; the pipeline logs them to the run's MLflow
            artifacts under ``evaluation/``. An error in it fails registration with your frames (nothing is
            registered; ``resume`` registers once it is fixed). Needs ``load_model``.
        model_metadata: ``model_metadata(config) -> {key: JSON value}``: what the registered model carries in its
            MLflow metadata (its ``MLmodel`` file) beside the pipeline's own ``run_key``, ``train_code`` and
            ``dataset_hash``, which it may not set: class labels, feature names, units, what the output means.
            Called on the driver when the run registers; whoever loads the model reads it back with
            ``mlflow.models.get_model_info(model_uri).metadata``. An error in it fails registration as one in
            ``artifacts`` does. Needs ``load_model``.
        prepare: ``prepare(config, folder)``: the run's prepare-data step. Load or download your data, split and
            preprocess it, and write the result, in any files and format, into ``folder`` (an empty local
            directory). It runs once per run, where the flow runs, before any worker is asked for. The pipeline
            keeps the folder in ``<storage_path>/datasets/<content hash>/`` (the same data is stored once, however
            many runs use it), records the hash in the MLflow run (``prefect_raytrain.dataset_hash``), and hands
            your code ``config["data_dir"]``: a local folder holding those exact files, on every worker and on the
            driver (for ``datasets``, ``load_model``, ``input_example`` and ``evaluate``), on any node of a cluster.
            Files that no longer hash to the recorded content are refused: treat ``data_dir`` as read-only, and
            write the same bytes for the same data (seeded, no timestamps). A resume runs ``prepare`` again and is
            refused if the data changed: a run continues on the data it started with. None: your code reads its
            data where it is (and ``data_dir`` is a key like any other). It may return one line on what it wrote
            (``"1437 train / 180 val / 180 test rows, 64 features, 10 classes"``): the prepare-data log line, the
            Prefect run page and the MLflow dataset input's profile show it beside the content hash.
        schema: ``schema(config) -> {key: JSON value}``: what the model's inputs and outputs mean beyond their
            shapes, e.g. ``{"features": [...names in order], "classes": [...labels in order]}``. Each registered
            version records its digest (tag ``schema.digest``: the first 16 hex digits of the SHA-256 of
            ``json.dumps(schema)``, keys in the order given); a champion of another schema, or of none, is not
            compared with this run's model: it keeps ``champion`` and the reason is recorded, unless
            ``replace_incomparable_champion`` is on. Called once on the driver when the run registers (with
            ``data_dir``), before anything is registered. None: no schema is recorded, and the MLflow signature
            (types and shapes) decides, unless the champion recorded one (then it is incomparable). Needs
            ``load_model``.
        model_name: ``model_name(config) -> str``: the MLflow registered model a run registers into when it leaves
            the ``model_name`` setting at its default, e.g. one per region (``f"sales-{config['region']}"``): the
            gate only compares models of one name, so data whose scores are not comparable needs a name of its
            own. Called where the run starts (``config["data_dir"]`` is None then), and again by a crash
            continuation: the same config must give the same name. 1-200 letters, digits, spaces, ``.``, ``_``,
            ``-``, starting with a letter or digit. None: the module of ``train_code`` (``my_project.train``).
    """

    train_func: Callable[[dict[str, Any]], None]
    metric: MetricChoice
    load_model: Callable[[Path, dict[str, Any]], Any] | None = None
    input_example: Callable[[dict[str, Any]], Any] | None = None
    datasets: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    gate_metric: str = ""
    evaluate: Callable[[Any, dict[str, Any]], Mapping[str, float]] | None = None
    prepare: Prepare | None = None
    settings: type | None = None
    artifacts: Callable[[Any, dict[str, Any], Path], None] | None = None
    model_metadata: ModelMetadata | None = None
    schema: ModelMetadata | None = None
    model_name: Callable[[dict[str, Any]], str] | None = None

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
        check_code_config("TrainFunc", self.defaults, self.settings, self.prepare)
        for name in ("evaluate", "artifacts", "model_metadata", "schema"):
            if getattr(self, name) is not None and self.load_model is None:
                raise TypeError(
                    f"TrainFunc({name}=...) works on registered models: it needs load_model and input_example"
                )
        functions = ("load_model", "input_example", "datasets", "evaluate", "prepare", "artifacts", "model_metadata")
        for name in (*functions, "schema", "model_name"):
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
class TrainSpec:
    """Your model, data, loss and metrics; the pipeline's own loop trains them (DDP through ``prepare_model``,
    sharded data loading, a checkpoint every epoch, a resume that continues the same trajectory, the held-out
    test split scored for the gate). Point ``train_code`` at it as at a ``TrainFunc``.

    Attributes:
        data: ``data(config) -> Splits``. Torch Datasets: runs on every worker, and must give the same splits
            every time (read files, or split with a fixed seed); the pipeline records a content hash of them, and a
            resume on other data is refused. Ray Datasets: runs only where the flow runs (workers get shards).
        model: ``model(config, example) -> torch.nn.Module`` from the config and an example input batch (its shape
            tells input sizes).
        loss: ``loss(outputs, targets) -> scalar tensor``, the mean over the batch; trained on, and reported as
            ``train_loss``, ``val_loss``, ``test_loss``.
        metrics: ``metrics(outputs, targets) -> {name: mean over the batch}``; reported as ``val_<name>`` and
            ``test_<name>``, averaged over each whole split.
        metric: which of them decides (``Metric("accuracy", higher_is_better=True)`` or ``Metric("loss", False)``,
            or a function of ``config`` returning one, as for ``TrainFunc``):
            ``val_<name>`` picks the best checkpoint, ``test_<name>`` is what the gate compares: the champion's and
            this run's model each scored on this run's test split (as ``TrainFunc.evaluate`` does).
        optimizer: ``optimizer(parameters, config)``; default Adam with ``config["lr"]``.
        input_example: ``input_example(config)`` -> what the registered model is exported with; default: two inputs
            of the train split.
        defaults: values for ``config`` that apply when neither ``train_config`` nor the pipeline sets them.
        settings: your code's own settings as a class, instead of ``defaults``, as for ``TrainFunc``.
        artifacts: ``artifacts(model, config, folder)``: files about the registered model, as for ``TrainFunc``.
        model_metadata: ``model_metadata(config) -> {key: JSON value}``: the registered model's MLflow metadata
            (class labels, ...), as for ``TrainFunc``.
        prepare: ``prepare(config, folder)``, as for ``TrainFunc``: ``data(config)`` then reads the files from
            ``config["data_dir"]``, the same on the driver and every worker, wherever they run.
        schema: ``schema(config) -> {key: JSON value}``: what the model's inputs and outputs mean (feature names,
            class labels); a champion of another schema is not compared, as for ``TrainFunc``.
        model_name: ``model_name(config) -> str``: the registered model's name where the run leaves the
            ``model_name`` setting at its default, as for ``TrainFunc``.
    """

    data: Callable[[dict[str, Any]], Splits]
    model: Callable[[dict[str, Any], Any], Any]
    loss: Callable[[Any, Any], Any]
    metric: MetricChoice
    metrics: Callable[[Any, Any], Mapping[str, Any]] | None = None
    optimizer: Callable[[Any, dict[str, Any]], Any] | None = None
    input_example: Callable[[dict[str, Any]], Any] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    prepare: Prepare | None = None
    settings: type | None = None
    artifacts: Callable[[Any, dict[str, Any], Path], None] | None = None
    model_metadata: ModelMetadata | None = None
    schema: ModelMetadata | None = None
    model_name: Callable[[dict[str, Any]], str] | None = None

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
        for name in ("prepare", "artifacts", "model_metadata", "schema", "model_name"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"TrainSpec({name}=...) must be a function, got {getattr(self, name)!r}")
        check_code_config("TrainSpec", self.defaults, self.settings, self.prepare)


def spec_metric_problem(spec: TrainSpec, metric: Metric) -> str:
    """ "" when a spec's loop reports ``metric`` (the loss, or one of its ``metrics``); else why not."""
    if metric.name != "loss" and spec.metrics is None:
        return f"TrainSpec(metric={metric.name!r}) needs metrics=... that computes it (or 'loss')"
    return ""
