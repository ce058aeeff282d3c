"""A sweep's search space and its trials' bookkeeping, as pure functions: what a search may say, what each trial
trains with, its run key, and which trial is best. The sweep for real: tests/flows/test_sweep.py."""

from __future__ import annotations

from typing import Any

import pytest

from raytrain_driver.search_space import Dimension, parse_search, unknown_key_refusal
from raytrain_driver.sweep_run import plan_search
from raytrain_driver.tuning import SweepPlan, Trial, best_trial, trial_config, trial_line, trial_run_key
from raytrain_tasks.config import RUN_KEY_PATTERN, TrainingConfig
from raytrain_tasks.errors import SettingsError

SETTINGS = frozenset(TrainingConfig.model_fields)


@pytest.mark.parametrize(
    ("search", "dimensions"),
    [
        ({"hidden": [32, 64]}, [Dimension("hidden", "choice", (32, 64), in_code=True)]),
        ('{"learning_rate": {"loguniform": [1e-4, 0.1]}}',
         [Dimension("learning_rate", "loguniform", (1e-4, 0.1), False)]),
        ({"batch_size": {"grid": [32, 64]}}, [Dimension("batch_size", "grid", (32, 64), in_code=False)]),
        ({"seed": {"randint": [0, 10]}, "dropout": {"uniform": [0.0, 0.5]}},
         [Dimension("seed", "randint", (0, 10), False), Dimension("dropout", "uniform", (0.0, 0.5), True)]),
    ],
)  # fmt: skip
def test_a_search_names_settings_or_code_keys_and_how_each_varies(search: Any, dimensions: list[Dimension]) -> None:
    assert list(parse_search(search, SETTINGS)) == dimensions


@pytest.mark.parametrize(
    ("search", "says"),
    [
        ("{not json", "not valid JSON"),
        ({}, "a JSON object of settings to vary"),
        ({"hidden": 64}, "give a list of values"),
        ({"hidden": {"normal": [0, 1]}}, "give a list of values, or one of choice, grid"),
        ({"hidden": []}, "takes a non-empty list"),
        ({"learning_rate": {"uniform": [0.1, 0.01]}}, "low below high"),
        ({"learning_rate": {"loguniform": [0, 0.1]}}, "bounds above 0"),
        ({"seed": {"randint": [0, 2.5]}}, "two integers"),
        ({"model_name": ["a", "b"]}, "the same for every trial of a sweep"),
        # A deployment pins where a run stores, tracks and runs: a search must not point a trial elsewhere.
        ({"s3_endpoint_url": ["http://elsewhere:9000"]}, r"search\['s3_endpoint_url'\]: s3_endpoint_url is the same"),
        ({"mlflow_tracking_uri": ["http://elsewhere"]}, "is the same for every trial"),
        ({"epochs": [5, 20]}, "is the same for every trial"),  # ASHA's rungs follow from the sweep's epochs
        ({"checkpoint_every_steps": [50]}, "is the same for every trial"),
        ({"min_improvement": [0.0, 0.1]}, "is the same for every trial"),  # the gate's rules are the sweep's
    ],
)
def test_a_search_that_says_nothing_clear_is_refused_naming_the_key(search: Any, says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        parse_search(search, SETTINGS)


@pytest.mark.parametrize(
    ("settings", "search", "says"),
    [
        ({}, {"learning_rate": [0.01, -1]}, r"search\['learning_rate'\]: the value -1 is refused"),
        ({}, {"hiden_sizes": [[32]]}, r"search\['hiden_sizes'\].*did you mean 'hidden_sizes'"),
        ({}, {"learning_rat": [0.1]}, r"search\['learning_rat'\]: no setting .*did you mean 'learning_rate'"),
        ({"checkpoint_every_steps": 50}, {"learning_rate": [0.01]}, "checkpoint_every_steps"),
        ({}, {"learning_rate": [0.01, 0.1], "hidden_sizes": [[32], [64, 64]]}, None),
    ],
)
def test_every_value_a_trial_could_get_is_checked_before_anything_starts(
    settings: dict[str, Any], search: dict[str, Any], says: str | None
) -> None:
    config = TrainingConfig(**settings)
    if says is None:
        assert len(plan_search(config, search)) == 2
        return
    with pytest.raises(SettingsError, match=says):
        plan_search(config, search)


@pytest.mark.parametrize(
    ("name", "code_keys", "declares_all", "says"),
    [
        ("learning_rate", (), False, ""),
        ("hidden", ("hidden", "dropout"), True, ""),
        ("learning_rat", ("hidden",), False, "did you mean 'learning_rate'"),  # varies nothing: refused anyway
        ("hiden", ("hidden",), False, "did you mean 'hidden'"),
        ("width", ("hidden",), False, ""),  # plain defaults: the code may read keys it has no default for
        ("width", ("hidden", "dropout"), True, "train_config (hidden, dropout)"),  # its settings class has none
        ("batchsize", ("hidden",), True, "did you mean 'batch_size'"),
        ("eval_batch_size", ("hidden",), False, ""),  # a key of its own, not a slip of batch_size
        ("max_learning_rate", ("hidden",), False, ""),
        ("learningrate", ("hidden",), False, "did you mean 'learning_rate'? If your code reads 'learningrate'"),
        ("sed", ("hidden",), False, "did you mean 'seed'"),
        ("seeds", ("hidden",), False, "did you mean 'seed'"),
    ],
)
def test_a_searched_name_that_is_no_setting_is_refused_with_the_nearest(
    name: str, code_keys: tuple[str, ...], declares_all: bool, says: str
) -> None:
    refusal = unknown_key_refusal(name, code_keys, declares_all)
    assert (says in refusal and refusal.startswith(f"search[{name!r}]: no setting")) if says else refusal == ""
    if says:
        assert "batch_size, learning_rate, seed" in refusal  # what a search varies, whatever the code


def test_a_secret_of_the_codes_settings_is_never_searched() -> None:
    with pytest.raises(SettingsError, match="a secret of your code's settings is not searched"):
        parse_search({"api_token": ["a", "b"]}, SETTINGS, frozenset({"api_token"}))


@pytest.mark.parametrize(
    ("settings", "grace", "says"),
    [
        ({"epochs": 3}, 3, "grace_period 3 must be below epochs 3"),
        ({"epochs": 2}, 1, None),
        ({"num_workers": 1, "max_workers": 2}, 1, "fixed number of workers"),
        ({"resume": "20261206-120000-abcdef"}, 1, "continued with sweep_key"),
    ],
)
def test_a_sweeps_own_settings_that_asha_or_its_trials_cannot_follow_are_refused(
    settings: dict[str, Any], grace: int, says: str | None
) -> None:
    config = TrainingConfig(**settings)
    if says is None:
        assert plan_search(config, {"learning_rate": [0.1]}, grace)
        return
    with pytest.raises(SettingsError, match=says):
        plan_search(config, {"learning_rate": [0.1]}, grace)


@pytest.mark.parametrize(
    ("settings", "resources", "at_once"),
    [
        ({"num_workers": 2}, {"CPU": 2.0}, 1),
        ({"num_workers": 2}, {"CPU": 8.0}, 4),
        ({"num_workers": 2, "cpus_per_worker": 2.0}, {"CPU": 8.0}, 2),
        ({"num_workers": 2, "use_gpu": True}, {"CPU": 8.0, "GPU": 2.0}, 1),  # a GPU per worker
        ({"num_workers": 4}, {"CPU": 2.0}, 1),  # never none: the one trial waits for its workers, as a fit does
    ],
)
def test_as_many_trials_run_at_once_as_the_cluster_holds_their_workers(
    settings: dict[str, Any], resources: dict[str, float], at_once: int
) -> None:
    from raytrain_driver.tuning import _trials_at_once

    assert _trials_at_once(TrainingConfig(**settings), resources) == at_once


def test_a_trial_trains_the_sweeps_settings_with_its_draw_and_never_registers_itself() -> None:
    base = TrainingConfig(epochs=5, train_config={"dataset": "digits"}, register=True)
    dimensions = parse_search({"learning_rate": [0.1], "hidden_sizes": [[8]]}, SETTINGS)
    plan = SweepPlan(base.model_dump(), dimensions, None, "20261206-120000-abcdef", "parent")
    trial = trial_config(plan, {"learning_rate": 0.1, "hidden_sizes": [8]})
    assert (trial.learning_rate, trial.epochs, trial.register) == (0.1, 5, False)
    assert trial.train_config == {"dataset": "digits", "hidden_sizes": [8]}


def test_a_trials_run_key_follows_from_the_sweep_and_the_trial() -> None:
    keys = [trial_run_key("20261206-120000-abcdef", trial) for trial in ("a1_00000", "a1_00001", "a1_00000")]
    assert all(RUN_KEY_PATTERN.fullmatch(key) for key in keys)
    assert keys[0] == keys[2] != keys[1] and keys[0].startswith("20261206-120000-")


def _trial(score: float | None, finished: bool = True, key: str = "k") -> Trial:
    return Trial("t", key, {}, 2 if finished else 1, score, finished)


@pytest.mark.parametrize(
    ("trials", "higher", "best"),
    [
        ([_trial(0.8, key="a"), _trial(0.9, key="b")], True, "b"),
        ([_trial(0.8, key="a"), _trial(0.9, key="b")], False, "a"),  # lower is better (a loss)
        ([_trial(0.99, finished=False, key="a"), _trial(0.9, key="b")], True, "b"),  # stopped early: never best
        ([_trial(0.9, key="a"), _trial(0.9, key="b")], True, "a"),  # a tie: the first
        ([_trial(None, key="a"), _trial(0.5, finished=False)], True, None),  # none trained every epoch
    ],
)
def test_the_best_trial_is_the_best_one_that_trained_every_epoch(
    trials: list[Trial], higher: bool, best: str | None
) -> None:
    found = best_trial(trials, higher)
    assert (found.run_key if found else None) == best


@pytest.mark.parametrize(
    ("result", "metric", "line"),
    [
        (
            {"epoch": 1, "val_accuracy": 0.912345, "training_iteration": 1},
            "val_accuracy",
            "epoch 2/3: val_accuracy=0.9123",
        ),
        ({"training_iteration": 1, "val_loss": 0.5}, "val_loss", "epoch 1/3: val_loss=0.5"),  # no epoch reported
        ({"epoch": 0}, "val_loss", "epoch 1/3: val_loss=?"),
    ],
)
def test_a_trials_epoch_is_one_line_counted_from_one(result: dict[str, Any], metric: str, line: str) -> None:
    assert trial_line("20261206-120000-abcdef", result, metric, 3) == f"trial 20261206-120000-abcdef {line}"


def test_a_continued_sweeps_trial_lines_go_to_the_run_continuing_it() -> None:
    """Tune keeps its callbacks in the sweep's record and a continued sweep calls the kept ones: their lines must
    reach the logger of the task running now, not that of the killed run that made them."""
    import logging
    from types import SimpleNamespace

    from ray import cloudpickle

    from raytrain_driver.hooks import RunHooks, run_hooks
    from raytrain_driver.tuning import trial_lines

    heard: dict[str, list[str]] = {"killed": [], "continuing": []}
    loggers = {}
    for name, lines in heard.items():
        loggers[name] = logging.getLogger(f"tests.sweep.{name}")
        handler = logging.Handler()
        handler.emit = lambda record, lines=lines: lines.append(record.getMessage())  # type: ignore[method-assign]
        loggers[name].addHandler(handler)
        loggers[name].setLevel(logging.INFO)
    with run_hooks(RunHooks(loggers["killed"])):
        kept = cloudpickle.dumps(trial_lines("20261206-120000-abcdef", "val_accuracy", 2))
    with run_hooks(RunHooks(loggers["continuing"])):
        restored = cloudpickle.loads(kept)
        restored.on_trial_result(1, [], SimpleNamespace(trial_id="t1"), {"epoch": 0, "val_accuracy": 0.5})
    key = trial_run_key("20261206-120000-abcdef", "t1")
    assert heard == {"killed": [], "continuing": [f"trial {key} epoch 1/2: val_accuracy=0.5"]}
