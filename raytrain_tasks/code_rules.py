"""The rules a ``TrainFunc`` or ``TrainSpec`` (raytrain_tasks.api) and a run's ``train_config`` are checked
against: which keys are the pipeline's, and what may be an MLflow param."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any

from raytrain_tasks.errors import PIPELINE_KEY_ALIASES

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


def spec_metric_problem(spec: Any, metric: Any) -> str:
    """ "" when a spec's loop reports ``metric`` (the loss, or one of its ``metrics``); else why not."""
    if metric.name != "loss" and spec.metrics is None:
        return f"TrainSpec(metric={metric.name!r}) needs metrics=... that computes it (or 'loss')"
    return ""
