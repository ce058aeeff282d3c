"""The table classifier's settings live in its train_config: the run's config has none of them, a run stored
before they moved is continued with them carried there, and the CLI's shorthand writes them there."""

from __future__ import annotations

import pytest

from flows.cli import parse_args
from raytrain_tasks.config import SETTINGS, TrainingConfig, config_from_parameters
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.moved_settings import MOVED, carried_into_train_config
from raytrain_tasks.settings import TABLE_CLASSIFIER
from raytrain_tasks.table_classifier.spec import Settings

OLD_PARAMETERS = {
    "dataset": "customers.csv",
    "label_column": "plan",
    "split_key_column": "customer_id",
    "val_fraction": 0.25,
    "test_fraction": 0.15,
    "hidden_sizes": [32, 16],
    "data_loader": "ray_data",
    "input_example": "validation_rows",
    "promotion_metric": "val_loss",
    "model": "mlp",
}


def test_the_runs_config_has_none_of_the_table_classifiers_settings() -> None:
    """No flag, form field or MLflow param of the run is the table classifier's: they are its own."""
    assert not set(MOVED) & set(SETTINGS)
    assert not set(MOVED) & set(TrainingConfig().public_params(secret_keys=()))
    assert set(Settings.model_fields) >= {key for key, _ in MOVED.values() if key}


def test_a_stored_runs_old_parameters_become_the_classifiers_train_config_under_its_names() -> None:
    """A flow run stored before the move, continued: each setting is in train_config under the classifier's
    name (promotion_metric val_loss -> metric loss: it picks on val_, the gate compares test_), and the
    classifier's own validation takes them."""
    stored = {**OLD_PARAMETERS, "train_config": '{"synthetic_samples": 500}', "epochs": 2}
    config = config_from_parameters(stored)
    expected = {key: value for key, value in OLD_PARAMETERS.items() if key not in ("model", "promotion_metric")}
    assert config.train_config == {**expected, "metric": "loss", "synthetic_samples": 500}
    assert config.epochs == 2 and config.train_code == TABLE_CLASSIFIER
    Settings(**config.train_config)
    assert config_from_parameters(config.model_dump()) == config  # a second continuation agrees


@pytest.mark.parametrize(
    ("parameters", "train_config"),
    [
        ({"dataset": "digits", "hidden_sizes": [128, 64], "promotion_metric": "val_accuracy"}, {}),  # old defaults
        ({"dataset": "synthetic", "train_config": {"dataset": "synthetic"}}, {"dataset": "synthetic"}),  # same twice
        ({"hidden_sizes": (8,)}, {"hidden_sizes": [8]}),
        ({"model": "mlp"}, {}),  # no key: the classifier's one model
    ],
)
def test_what_is_carried(parameters: dict[str, object], train_config: dict[str, object]) -> None:
    assert carried_into_train_config(parameters).get("train_config", {}) == train_config


def test_other_code_never_used_them_so_they_are_dropped() -> None:
    """Your own code brings its own data and gate: the old settings did nothing for it and do nothing now."""
    stored = {"train_code": "my_model.train:training", "dataset": "customers.csv", "promotion_metric": "val_loss"}
    assert carried_into_train_config(stored) == {"train_code": "my_model.train:training"}


def test_one_setting_given_two_values_is_refused_naming_both_and_quoting_neither() -> None:
    clash = {
        "promotion_metric": "val_loss",
        "dataset": "s3://tables/t.csv",
        "train_config": {"metric": "accuracy", "dataset": "s3://tables/secret-t0ken.csv"},
    }
    with pytest.raises(SettingsError) as refused:
        config_from_parameters(clash)
    message = str(refused.value)
    assert "promotion_metric and train_config.metric" in message and "dataset and train_config.dataset" in message
    assert "secret-t0ken" not in message and "val_loss" not in message


def test_settings_that_overfill_train_config_are_refused_naming_train_config() -> None:
    """train_config is one MLflow param (6000 characters at most)."""
    with pytest.raises(SettingsError, match=r"train_config \(--train-config\).*more than the 6000"):
        config_from_parameters({"dataset": "/data/" + "t" * 3000 + ".csv", "label_column": "l" * 3000})


def test_the_cli_shorthand_writes_train_config() -> None:
    """`--dataset churn.csv --label-column churned` is `--train-config '{"dataset": ..., "label_column": ...}'`."""
    config, _ = parse_args(
        ["--dataset", "churn.csv", "--label-column", "churned", "--train-config", '{"synthetic_samples": 400}']
    )
    assert config.train_config == {"dataset": "churn.csv", "label_column": "churned", "synthetic_samples": 400}
    assert parse_args(["--dataset", "digits"])[0].train_config == {"dataset": "digits"}


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--synthetic-samples", "400"],
            "--synthetic-samples is a setting of the table classifier: give it in "
            "--train-config, e.g. --train-config '{\"synthetic_samples\": ...}'",
        ),
        (["--promotion-metric=val_loss"], "--train-config '{\"metric\": ...}'"),
        (["--train-code", "my_model.train:training", "--dataset", "x.csv"], "--dataset: the table classifier's"),
        (["--dataset", "a.csv", "--train-config", '{"dataset": "b.csv"}'], "--dataset and --train-config give one"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        # Not read as --model-name, which it begins.
        (["--model", "mlp"], "--model is gone: the MLP is the table classifier's one model"),
        # The shorthand's value is given, even where it is the classifier's default.
        (["--dataset", "digits", "--train-config", '{"dataset": "synthetic"}'], "give one key different values"),
    ],
)
def test_the_cli_refuses_moved_flags_naming_where_they_went(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_a_continuation_of_a_run_of_the_built_in_classifier_is_refused_saying_it_cannot_be_resumed() -> None:
    """A run started by releases up to 0.2 logged train_code ''. A continuation (a crashed deployment run, whose
    parameters leave train_code out, or `train --resume`) would train the table classifier on its checkpoints: it
    is refused before it trains, saying the run cannot be resumed and what to do."""
    from raytrain_tasks.errors import TrackingError
    from raytrain_tasks.tracking.runs import _check_params_unchanged

    continued = config_from_parameters({"dataset": "synthetic"})
    logged = {key: str(value) for key, value in continued.public_params(secret_keys=()).items()} | {"train_code": ""}
    with pytest.raises(TrackingError, match=r"releases up to 0\.2 \(train_code ''\), which is gone") as refused:
        _check_params_unchanged(logged, continued.public_params(secret_keys=()), "20260101-000000-abcdef")
    assert "cannot be resumed" in str(refused.value) and "without `resume`" in str(refused.value)
    assert "--train-code ''" not in str(refused.value)


def test_the_table_classifier_reaches_a_cluster_as_part_of_the_pipelines_own_code() -> None:
    """Its package is raytrain_tasks', which every cluster run ships: not a second time as the user's package."""
    import raytrain_tasks
    from raytrain_driver.cluster import cluster_runtime_env

    assert cluster_runtime_env(TrainingConfig(ray_address="127.0.0.1:6379"))["py_modules"] == [raytrain_tasks]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("dataset", "imagenet"),
        ("dataset", "data.txt"),
        ("hidden_sizes", [64, 0]),
        ("hidden_sizes", []),
        ("val_fraction", 1.5),
        ("label_column", ""),
        ("metric", "f1"),
    ],
)
def test_the_classifiers_settings_refuse_a_bad_value_naming_its_key(key: str, value: object) -> None:
    """What the run's config checked for these settings, the classifier's own settings check now (the pre-flight
    validates them before any worker starts)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=key):
        Settings(**{key: value})


@pytest.mark.parametrize("dataset", ["digits", "synthetic", "data/train.csv", "s3://b/k/data.parquet", "x.PQ"])
def test_accepted_datasets(dataset: str) -> None:
    assert Settings(dataset=dataset).dataset == dataset
