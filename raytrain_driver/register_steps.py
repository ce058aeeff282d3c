"""The steps of register-model that concern the run's code (``train_code``): its model, and the gate.

The model is made by the user's ``load_model`` from a verified local copy of the best checkpoint and logged in
MLflow's ``pt2`` format with the user's input example. A champion is comparable only when the same ``train_code``
registered it on the same metric. The gate compares the user's metric, in its direction: with the code's
``evaluate`` (a TrainSpec's test split), the champion and this run's model each loaded back from the registry (only
this project's exact pt2 layout, with pickles off: raytrain_driver.champion) and scored on this run's data; without
it, as each version's best checkpoint reported it (the champion's model is then never loaded).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_driver.champion import (
    SCHEMA_TAG,
    TRAIN_CODE_TAG,
    check_model_layout,
    digest_of_schema,
    download_model,
    read_champion,
)
from raytrain_driver.promotion import Champion
from raytrain_tasks.api import TrainFunc
from raytrain_tasks.code_rules import PIPELINE_METADATA
from raytrain_tasks.code_settings import secret_keys
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import UnsafeCheckpointError, UserCodeError
from raytrain_tasks.safe_load import pickle_deserialization_off
from raytrain_tasks.settings import TABLE_CLASSIFIER
from raytrain_tasks.storage.locations import download_dir, locate
from raytrain_tasks.tracking import runs as tracking

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from raytrain_driver.fit_record import FitResult

GATE_METRIC_TAG = "gate.metric"
GATE_DIRECTION_TAG = "gate.higher_is_better"
GATE_SCORE_TAG = "gate.score"


def user_model(
    config: TrainingConfig, fit: FitResult, spec: TrainFunc, expected_digest: str | None, data_dir: Path | None = None
) -> tuple[Any, Any]:
    """(the user's model in eval mode, its input example as a numpy array) from the best checkpoint.

    The local copy must hash to the digest the controller recorded when the checkpoint was committed; the user's
    ``load_model`` (which may unpickle) never sees a folder that does not."""
    import numpy as np

    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.user_code import user_config

    assert spec.load_model is not None and spec.input_example is not None
    loop_config = user_config(config, spec, data_dir)
    with tempfile.TemporaryDirectory(prefix="prt-user-model-") as tmp:
        directory = download_dir(locate(fit.best_checkpoint_uri, config.storage_options), Path(tmp) / "checkpoint")
        actual = local_folder_digest(directory)
        if expected_digest is None or actual != expected_digest:
            raise UnsafeCheckpointError(
                f"checkpoint {fit.best_checkpoint_uri} is not the one run {fit.run_key} committed (its files hash to "
                f"{actual[:12]}..., the MLflow run recorded {(expected_digest or 'nothing')[:12]}...); nothing was "
                "loaded or registered. Check who can write `storage_path`"
            )
        try:
            model = spec.load_model(directory, loop_config)
            example = spec.input_example(loop_config)
        except Exception as exc:
            raise UserCodeError(
                f"train_code {config.train_code!r}: load_model or input_example failed on checkpoint "
                f"{fit.best_checkpoint_uri}: {type(exc).__name__}: {exc}"
            ) from exc
    if not hasattr(model, "eval"):
        raise UserCodeError(
            f"train_code {config.train_code!r}: load_model returned a {type(model).__name__}, not a torch.nn.Module"
        )
    example = example.detach().cpu().numpy() if hasattr(example, "detach") else np.asarray(example)
    _check_example_accepted(config, fit, model.eval(), example)
    return model, example


def _check_example_accepted(config: TrainingConfig, fit: FitResult, model: Any, example: Any) -> None:
    """The model must take ``input_example`` before MLflow exports it with it: a wrong shape is named here, not as
    the signature error MLflow's export gives (which names a serialization setting the user cannot change)."""
    import torch

    try:
        with torch.no_grad():
            model(torch.as_tensor(example))
    except Exception as exc:  # noqa: BLE001 - whatever the model raises on it, the example is what to fix (tested)
        raise UserCodeError(
            f"train_code {config.train_code!r}: the model load_model gives does not accept input_example (shape "
            f"{tuple(example.shape)}): {type(exc).__name__}: {exc}. input_example must be a batch your model takes, "
            f"shaped like your data's inputs; fix it, then `prefect-raytrain resume {fit.run_key}` registers this run "
            "without training it again"
        ) from exc


# torch.export keeps the module it exports in module-level globals (torch/export/_trace.py) and clears them when
# done: two exports at once in one process (two pipelines run in threads) failed with "_EXPORT_MODULE_HIERARCHY
# must not be None" (seen in test_registry's two pipelines registering at once). One export at a time.
EXPORT_LOCK = threading.Lock()


def version_tags(config: TrainingConfig, spec: TrainFunc | None, score: float, schema: str = "") -> dict[str, str]:
    """What makes a version's recorded score comparable: the code that trained it, its gate metric and the
    digest of the code's ``schema`` (``user_schema``); the score in full (``repr``), so that a tie with it is a
    tie, not a gain in the seventh decimal."""
    assert spec is not None, "every version this release registers is of a train_code"
    return {
        GATE_SCORE_TAG: repr(float(score)),
        TRAIN_CODE_TAG: config.train_code,
        GATE_METRIC_TAG: spec.gate.name,
        GATE_DIRECTION_TAG: str(spec.gate.higher_is_better).lower(),
        "train_config": config.train_config_shown(secret_keys(spec.settings))[:5000],
        **({SCHEMA_TAG: schema} if schema else {}),
    }


def user_schema(config: TrainingConfig, spec: TrainFunc, data_dir: Path | None) -> str:
    """The digest of what the code's ``schema(config)`` says ("" without one); UserCodeError (the user's frames)
    when it fails or gives no JSON mapping: nothing is registered."""
    if spec.schema is None:
        return ""
    return digest_of_schema(_code_mapping(config, spec, data_dir, "schema", spec.schema))


@dataclass(frozen=True)
class Candidate:
    """This run's model as the gate sees it: the run's config and code, the logged model, and its data."""

    config: TrainingConfig
    spec: TrainFunc
    uri: str  # models:/<model id> of the logged model
    data_dir: Path | None = None  # the local copy of the run's prepared data, for the code's evaluate
    schema: str | None = None  # this run's schema digest (user_schema); None: taken when needed


def assess_recorded_champion(client: MlflowClient, candidate: Candidate) -> Champion:
    """The champion's score as recorded when it was registered; incomparable unless the same training code
    registered it on the same metric and schema, with the same MLflow signature as the candidate's. Only a missing
    alias means there is none; a registry error leaves it open."""
    config, spec, data_dir, candidate_uri = candidate.config, candidate.spec, candidate.data_dir, candidate.uri
    name, schema = config.model_name, candidate.schema
    found = read_champion(client, name)
    if isinstance(found, Champion):
        return found
    version, tags = found
    if config.train_code == TABLE_CLASSIFIER:
        tags = _as_table_classifier(tags)
    if tags.get(TRAIN_CODE_TAG) != config.train_code:
        trainer = tags.get(TRAIN_CODE_TAG) or "the built-in classifier of releases up to 0.2"
        return Champion(
            version, incomparable=f"it was trained by {trainer}, this run by train_code {config.train_code!r}"
        )
    if (
        tags.get(GATE_METRIC_TAG) != spec.gate.name
        or tags.get(GATE_DIRECTION_TAG) != str(spec.gate.higher_is_better).lower()
    ):
        return Champion(
            version,
            incomparable=f"its gate metric was {tags.get(GATE_METRIC_TAG)!r} ("
            f"{'higher' if tags.get(GATE_DIRECTION_TAG) == 'true' else 'lower'} is better), this run's is "
            f"{spec.gate.name!r} ({'higher' if spec.gate.higher_is_better else 'lower'} is better)",
        )
    schema = user_schema(config, spec, data_dir) if schema is None else schema
    if (recorded_schema := tags.get(SCHEMA_TAG, "")) != schema:
        return Champion(
            version,
            incomparable=f"its input schema ({recorded_schema or 'none recorded'}) is not this run's "
            f"({schema or 'none'}; train_code's schema(config)): its inputs or outputs mean something else",
        )
    if candidate_uri:
        from mlflow.exceptions import MlflowException

        try:
            differs = signature_change(f"models:/{name}/{version}", candidate_uri)
        except (MlflowException, OSError) as exc:  # the registry or artifact store: decided later, nothing moves
            return Champion(version, error=f"reading {name} version {version}'s signature failed: {_named(exc)}")
        if differs:
            return Champion(version, incomparable=differs)
    if spec.evaluate is not None:
        return _evaluated_champion(name, version, config, spec, data_dir)
    recorded = tags.get(GATE_SCORE_TAG, tags.get(spec.gate.name))
    try:
        return Champion(version, score=float(json.loads(recorded or "null")))
    except (TypeError, ValueError):
        return Champion(version, error=f"{name} version {version} records no {spec.gate.name} score ({recorded!r})")


# Versions registered by releases up to 0.2 (their built-in classifier) record their schema and the gate's metric in
# other tags, and no train_code.
_BUILTIN_GATES = {"test_accuracy": "true", "test_loss": "false"}  # its promotion_metric's, and their direction


def _as_table_classifier(tags: dict[str, str]) -> dict[str, str]:
    """A version of releases up to 0.2, tagged as the table classifier's would be: the same model of
    the same table (its schema digest, the same formula), gated on the same metric. Other tags as they are."""
    metric = tags.get("promotion.metric", "")
    if TRAIN_CODE_TAG in tags or SCHEMA_TAG not in tags or metric not in _BUILTIN_GATES:
        return tags
    return {
        **tags,
        TRAIN_CODE_TAG: TABLE_CLASSIFIER,
        GATE_METRIC_TAG: metric,
        GATE_DIRECTION_TAG: _BUILTIN_GATES[metric],
    }


def assess_user_champion(client: MlflowClient, candidate: Candidate, recorded: float) -> tuple[Champion, float]:
    """(the champion, the candidate's score) as the gate compares them: both scored by the code's ``evaluate`` on
    this run's data when it has one and the champion is comparable; else the scores recorded at training time
    (``recorded``: the candidate's)."""
    champion = assess_recorded_champion(client, candidate)
    config, spec, data_dir, candidate_uri = candidate.config, candidate.spec, candidate.data_dir, candidate.uri
    if spec.evaluate is None or champion.score is None:
        return champion, recorded
    try:
        return champion, _evaluate_registered(candidate_uri, config, spec, data_dir)
    except Exception as exc:  # noqa: BLE001 - a candidate that cannot be scored like the champion moves nothing (tested)
        failed = f"scoring this run's model with evaluate failed: {_named(exc)}"
        return Champion(champion.version, error=failed), recorded


def signature_change(champion_uri: str, candidate_uri: str) -> str:
    """Why the two models' MLflow signatures (their inputs' and outputs' names, types and shapes) differ; "" when
    they agree or either has none. A model another shape of input or output cannot stand in for the champion
    (whoever calls it would break), nor be scored on the same data as it: incomparable, as a champion of another
    input schema is."""
    from mlflow.models import get_model_info

    theirs = get_model_info(champion_uri).signature
    ours = get_model_info(candidate_uri).signature
    if theirs is None or ours is None or theirs.to_dict() == ours.to_dict():
        return ""
    return (
        f"its signature (inputs {theirs.inputs}, outputs {theirs.outputs}) differs from this run's model's (inputs "
        f"{ours.inputs}, outputs {ours.outputs}): a client of the champion could not call it in its place"
    )


def _evaluated_champion(
    name: str, version: str, config: TrainingConfig, spec: TrainFunc, data_dir: Path | None
) -> Champion:
    """The champion scored by the code's ``evaluate`` on this run's data; any failure leaves it in place."""
    try:
        return Champion(version, score=_evaluate_registered(f"models:/{name}/{version}", config, spec, data_dir))
    except ForeignModelError as exc:
        return Champion(version, incomparable=str(exc))
    except Exception as exc:  # noqa: BLE001 - any failure to load or score the champion leaves it in place (tested)
        return Champion(version, error=f"loading or scoring {name} version {version} failed: {_named(exc)}")


class ForeignModelError(Exception):
    """A registered model in another format than this project logs: its scores are not comparable."""


def _evaluate_registered(model_uri: str, config: TrainingConfig, spec: TrainFunc, data_dir: Path | None) -> float:
    """The gate's metric of the registered model at ``model_uri``, as the code's ``evaluate`` scores it. Only this
    project's exact pt2 layout is loaded, with pickles off (raytrain_driver.champion); anything else is refused."""
    import mlflow

    from raytrain_tasks.user_code import user_config

    assert spec.evaluate is not None
    with tempfile.TemporaryDirectory(prefix="prt-evaluate-") as scratch:
        directory = download_model(model_uri, Path(scratch))
        layout = check_model_layout(directory)
        if layout.foreign:
            raise ForeignModelError(layout.foreign)
        if layout.tampered:
            raise UnsafeCheckpointError(
                f"{model_uri} was refused: {layout.tampered}. Look at who wrote there, then remove those files or "
                "point 'champion' at a version you trust"
            )
        with pickle_deserialization_off():
            model = mlflow.pytorch.load_model(str(directory))
    scores = dict(spec.evaluate(model, user_config(config, spec, data_dir)))
    if spec.gate.name not in scores:
        raise UserCodeError(
            f"train_code {config.train_code!r}: evaluate returned {sorted(scores)}, not the gate's metric "
            f"{spec.gate.name!r}"
        )
    return float(scores[spec.gate.name])


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def registering(config: TrainingConfig, fit: FitResult) -> Iterator[None]:
    """MLflow's fluent API (log_model, register_model, pyfunc) reads a process-wide URI that set_tracking_uri also
    exports as MLFLOW_TRACKING_URI: scoped here, so a later run in this process is not redirected. Code that trained
    on Ray Datasets builds them again to load, export and score its model: Ray is connected for it."""
    from raytrain_driver.cluster import ray_session

    if fit.ray_datasets:
        from raytrain_tasks.trainspec.data import quiet_ray_data

        quiet_ray_data()
    with ray_session(config) if fit.ray_datasets else contextlib.nullcontext():
        with tracking.using_tracking_uri(config.mlflow_tracking_uri):
            yield


def user_metadata(config: TrainingConfig, spec: TrainFunc, data_dir: Path | None) -> dict[str, Any]:
    """What the code's ``model_metadata(config)`` says about the model to register ({} without it): a mapping of
    JSON values that leaves the pipeline's own keys alone. UserCodeError (the user's frames) otherwise: nothing is
    registered, and ``resume`` registers once the code is fixed."""
    if spec.model_metadata is None:
        return {}
    given = _code_mapping(config, spec, data_dir, "model_metadata", spec.model_metadata)
    if taken := sorted(set(given) & set(PIPELINE_METADATA)):
        raise UserCodeError(
            f"train_code {config.train_code!r}: model_metadata(config) may not set {taken}: the pipeline sets them; "
            "name yours otherwise"
        )
    return given


def _code_mapping(config: TrainingConfig, spec: TrainFunc, data_dir: Path | None, name: str, function: Any) -> dict:
    """What one of the code's ``name(config)`` functions returns, as plain JSON types (MLflow writes metadata with
    yaml.safe_dump, which refuses numpy scalars and enums); UserCodeError (the user's frames) when it fails or
    returns anything else: nothing is registered, and ``resume`` registers once the code is fixed."""
    from raytrain_tasks.user_code import user_config, user_frames

    where = f"train_code {config.train_code!r}: {name}(config)"
    try:
        given = function(user_config(config, spec, data_dir))
    except Exception as exc:  # the user's function: named with its frames (test_user_gate's metadata and schema)
        raise UserCodeError(f"{where} failed, so nothing was registered: {user_frames(exc)}") from exc
    if not isinstance(given, Mapping) or not all(isinstance(key, str) for key in given):
        raise UserCodeError(f"{where} returned {type(given).__name__}, not a dict with str keys; nothing registered")
    try:
        return dict(json.loads(json.dumps(dict(given), allow_nan=False, default=_scalar)))
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: .item() of a tensor of several values
        raise UserCodeError(f"{where} returned a value that is not JSON ({exc}); nothing was registered") from exc


def _scalar(value: Any) -> Any:
    """A numpy (or torch) scalar as its Python number, for ``json.dumps``; TypeError for anything else."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()  # ValueError for an array of several values: "not JSON", as for a set
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


@contextlib.contextmanager
def user_artifacts(config: TrainingConfig, spec: TrainFunc, model: Any, data_dir: Path | None) -> Iterator[Path | None]:
    """A folder holding what the code's ``artifacts(model, config, folder)`` wrote about the model to register
    (None without ``artifacts``); UserCodeError with the user's frames when it fails: nothing is registered."""
    if spec.artifacts is None:
        yield None
        return
    from raytrain_tasks.user_code import user_config, user_frames

    with tempfile.TemporaryDirectory(prefix="prt-artifacts-") as tmp:
        try:
            spec.artifacts(model, user_config(config, spec, data_dir), Path(tmp))
        except Exception as exc:  # the user's function: named with its frames (test_user_gate's artifacts test)
            raise UserCodeError(
                f"train_code {config.train_code!r}: artifacts(...) failed, so nothing was registered: "
                f"{user_frames(exc)}"
            ) from exc
        yield Path(tmp)
