"""The built-in classifier's settings reach the table classifier (a TrainSpec) as its train_config."""

from __future__ import annotations

import pytest

from flows.cli import _train_code_problem
from raytrain_tasks.builtin_aliases import TABLE_CLASSIFIER, with_builtin_settings_carried
from raytrain_tasks.config import BUILTIN_CLASSIFIER_ONLY, TrainingConfig, ignored_with_train_code
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.table_classifier import Settings

BUILT_IN_FLAGS = {
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


def test_the_built_in_flags_become_the_classifiers_train_config_under_its_names() -> None:
    """`--dataset customers.csv --promotion-metric val_loss ...` with the table classifier: each setting is in
    train_config under the classifier's name (promotion_metric val_loss -> metric loss: it picks on val_, the
    gate compares test_), the classifier's settings accept them, and nothing is left set twice or ignored."""
    config = TrainingConfig(train_code=TABLE_CLASSIFIER, train_config='{"synthetic_samples": 500}', **BUILT_IN_FLAGS)
    carried = with_builtin_settings_carried(config)
    expected = {key: value for key, value in BUILT_IN_FLAGS.items() if key not in ("model", "promotion_metric")}
    assert carried.train_config == {**expected, "metric": "loss", "synthetic_samples": 500}
    Settings(**carried.train_config)  # the classifier's own validation takes them as they are
    for name in BUILTIN_CLASSIFIER_ONLY:  # one value in one place: the built-in's are back at their defaults
        assert getattr(carried, name) == TrainingConfig.model_fields[name].get_default(call_default_factory=True)
    assert ignored_with_train_code(carried) == []  # so no warning that they do nothing
    assert with_builtin_settings_carried(carried) == carried  # a resume, which reads the carried config, agrees


def test_only_the_table_classifier_takes_them() -> None:
    """Your own code brings its own data and gate: the built-in's settings stay where they are (and the run warns
    that they do nothing)."""
    config = TrainingConfig(train_code="my_model.train:training", dataset="customers.csv", promotion_metric="val_loss")
    assert with_builtin_settings_carried(config) is config


def test_the_runs_own_s3_settings_stay_the_runs() -> None:
    """s3_endpoint_url / s3_region are the run's storage settings, filled from the environment where the run
    starts: carried, a resume (which gives them back as flags) would find its train_config changed. The classifier
    reads an s3:// table through its own train_config's, else the environment's."""
    config = TrainingConfig(
        train_code=TABLE_CLASSIFIER, dataset="s3://tables/customers.csv", s3_endpoint_url="http://127.0.0.1:8333"
    )
    carried = with_builtin_settings_carried(config)
    assert carried.train_config == {"dataset": "s3://tables/customers.csv"}
    assert carried.s3_endpoint_url == "http://127.0.0.1:8333"


def test_settings_that_overfill_train_config_are_refused_naming_them() -> None:
    """train_config is one MLflow param (6000 characters at most): a carried setting that takes it past that is
    refused naming the setting, not with a validation traceback about a train_config the user never wrote."""
    config = TrainingConfig(
        train_code=TABLE_CLASSIFIER, dataset="/data/" + "t" * 3000 + ".csv", label_column="l" * 3000
    )
    with pytest.raises(SettingsError, match="dataset, label_column: carried into train_config"):
        with_builtin_settings_carried(config)


def test_one_setting_given_two_values_is_refused_naming_both_and_quoting_neither() -> None:
    """--label-column plan with train_config {"label_column": "tier"}: which was meant cannot be told. The same
    value twice is no conflict."""
    same = TrainingConfig(train_code=TABLE_CLASSIFIER, label_column="plan", train_config='{"label_column": "plan"}')
    assert with_builtin_settings_carried(same).train_config == {"label_column": "plan"}
    clash = TrainingConfig(
        train_code=TABLE_CLASSIFIER,
        promotion_metric="val_loss",
        dataset="s3://tables/t.csv",
        train_config='{"metric": "accuracy", "dataset": "s3://tables/secret-t0ken.csv"}',
    )
    with pytest.raises(SettingsError) as refused:
        with_builtin_settings_carried(clash)
    message = str(refused.value)
    assert "promotion_metric and train_config.metric" in message and "dataset and train_config.dataset" in message
    assert "secret-t0ken" not in message and "val_loss" not in message
    assert "promotion_metric and train_config.metric" in _train_code_problem(clash)  # before Prefect and Ray start


def test_the_table_classifier_is_what_a_run_trains_unless_it_names_other_code() -> None:
    """`make run`, a deployment without train_code, the UI's default form: the table classifier, with the
    built-in classifier's settings in its train_config, logged as such."""
    config = with_builtin_settings_carried(TrainingConfig(dataset="synthetic", hidden_sizes=[8]))
    assert config.train_code == TABLE_CLASSIFIER
    assert config.train_config == {"dataset": "synthetic", "hidden_sizes": [8]}
    params = config.public_params(secret_keys=())
    assert params["train_code"] == TABLE_CLASSIFIER and "dataset" not in params and "hidden_sizes" not in params


def test_a_continuation_of_a_run_of_the_built_in_classifier_is_refused_saying_it_cannot_be_resumed() -> None:
    """A run started by releases up to 0.2 logged train_code ''. A continuation (a crashed deployment run, whose
    parameters leave train_code out, or `train --resume`) would train the table classifier on its checkpoints: it
    is refused before it trains, saying the run cannot be resumed and what to do (it said to continue it with
    train_code '', which is refused now)."""
    from raytrain_tasks.errors import TrackingError
    from raytrain_tasks.tracking.runs import _check_params_unchanged

    continued = with_builtin_settings_carried(TrainingConfig(dataset="synthetic"))
    logged = {key: str(value) for key, value in continued.public_params(secret_keys=()).items()} | {"train_code": ""}
    with pytest.raises(TrackingError, match=r"releases up to 0\.2 \(train_code ''\), which is gone") as refused:
        _check_params_unchanged(logged, continued.public_params(secret_keys=()), "20260101-000000-abcdef")
    assert "cannot be resumed" in str(refused.value) and "without `resume`" in str(refused.value)
    assert "--train-code ''" not in str(refused.value)


def test_the_table_classifier_reaches_a_cluster_as_part_of_the_pipelines_own_code() -> None:
    """Its module is raytrain_tasks', which every cluster run ships: not a second time as the user's package."""
    import raytrain_tasks
    from raytrain_driver.cluster import cluster_runtime_env

    assert cluster_runtime_env(TrainingConfig(ray_address="127.0.0.1:6379"))["py_modules"] == [raytrain_tasks]
