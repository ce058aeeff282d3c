"""register-model for the user's own training code (``train_code``): what differs from the built-in classifier.

The model is made by the user's ``load_model`` from a verified local copy of the best checkpoint and logged in
MLflow's ``pt2`` format with the user's input example. The gate compares the user's metric, in its direction,
as the best checkpoint reported it; a champion is comparable only when the same ``train_code`` registered it on
the same metric. The champion's model is never loaded for this (nothing of it runs here).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_driver.champion import read_champion
from raytrain_driver.promotion import Champion
from raytrain_tasks.api import TrainFunc
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import UnsafeCheckpointError, UserCodeError
from raytrain_tasks.storage.locations import download_dir, locate

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from raytrain_driver.fit_record import FitResult

TRAIN_CODE_TAG = "train_code"
GATE_METRIC_TAG = "gate.metric"
GATE_DIRECTION_TAG = "gate.higher_is_better"
GATE_SCORE_TAG = "gate.score"


def user_model(config: TrainingConfig, fit: FitResult, spec: TrainFunc, expected_digest: str | None) -> tuple[Any, Any]:
    """(the user's model in eval mode, its input example as a numpy array) from the best checkpoint.

    The local copy must hash to the digest the controller recorded when the checkpoint was committed; the user's
    ``load_model`` (which may unpickle) never sees a folder that does not."""
    import numpy as np

    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.user_code import user_config

    assert spec.load_model is not None and spec.input_example is not None
    loop_config = user_config(config, spec)
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
    return model.eval(), example


def version_tags(config: TrainingConfig, spec: TrainFunc | None, score: float) -> dict[str, str]:
    """What makes a version's recorded score comparable: the code that trained it and its gate metric; the score
    in full (``repr``), so that a tie with it is a tie, not a gain in the seventh decimal."""
    assert spec is not None, "the built-in classifier's versions record their input schema instead"
    return {
        GATE_SCORE_TAG: repr(float(score)),
        TRAIN_CODE_TAG: config.train_code,
        GATE_METRIC_TAG: spec.gate.name,
        GATE_DIRECTION_TAG: str(spec.gate.higher_is_better).lower(),
        "train_config": config.train_config_text()[:5000],
    }


def assess_recorded_champion(client: MlflowClient, name: str, config: TrainingConfig, spec: TrainFunc) -> Champion:
    """The champion's score as recorded when it was registered; incomparable unless the same training code
    registered it on the same metric. Only a missing alias means there is none; a registry error leaves it open."""
    found = read_champion(client, name)
    if isinstance(found, Champion):
        return found
    version, tags = found
    if tags.get(TRAIN_CODE_TAG) != config.train_code:
        return Champion(
            version,
            incomparable=f"it was trained by {tags.get(TRAIN_CODE_TAG) or 'the built-in classifier'!s}, this run by "
            f"train_code {config.train_code!r}",
        )
    if (
        tags.get(GATE_METRIC_TAG) != spec.gate.name
        or tags.get(GATE_DIRECTION_TAG) != str(spec.gate.higher_is_better).lower()
    ):
        return Champion(
            version,
            incomparable=f"its gate metric was {tags.get(GATE_METRIC_TAG)!r} (higher is better: "
            f"{tags.get(GATE_DIRECTION_TAG)}), this run's is {spec.gate.name!r} ({spec.gate.higher_is_better})",
        )
    recorded = tags.get(GATE_SCORE_TAG, tags.get(spec.gate.name))
    try:
        return Champion(version, score=float(json.loads(recorded or "null")))
    except (TypeError, ValueError):
        return Champion(version, error=f"{name} version {version} records no {spec.gate.name} score ({recorded!r})")
