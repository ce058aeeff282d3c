"""The config and the CLI reject bad values at once, naming the field and its flag."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.cli import parse_config
from raytrain_tasks.config import TrainingConfig, config_from_parameters, describe_validation_error, new_run_key
from raytrain_tasks.errors import ClusterError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_workers", 0),
        ("learning_rate", -0.1),
        ("learning_rate", 0),
        ("epochs", 0),
        ("batch_size", 0),
        ("resume", "last-tuesday"),
        ("storage_path", "gs://bucket/prefix"),
        ("storage_path", "s3://"),
        ("s3_endpoint_url", "127.0.0.1:8333"),
        ("checkpoints_to_keep", 0),
        ("min_improvement", -0.01),
        ("min_improvement", float("nan")),
        ("min_improvement", float("inf")),
    ],
)
def test_invalid_value_is_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        TrainingConfig(**{field: value})
    message = describe_validation_error(info.value)
    assert field in message
    assert f"--{field.replace('_', '-')}" in message


def test_min_improvement_is_in_the_gate_metrics_units_not_capped_at_one() -> None:
    """The gate compares in the metric's own units: a margin of 5 on an RMSE, or of 2500 on a loss in the
    millions, is a setting like 0.01 on an accuracy."""
    assert TrainingConfig(min_improvement=5.0).min_improvement == 5.0
    assert TrainingConfig(min_improvement=2500).min_improvement == 2500.0


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(ValidationError, match="num_gpus"):
        TrainingConfig(num_gpus=2)  # type: ignore[call-arg]


def test_resolved_makes_paths_absolute_and_defaults_mlflow_under_state_dir(tmp_path: Path) -> None:
    resolved = TrainingConfig().resolved(tmp_path, environ={})
    assert resolved.storage_path == str(tmp_path / ".pipeline" / "storage")
    assert resolved.mlflow_tracking_uri == f"sqlite:///{tmp_path / '.pipeline' / 'mlflow.db'}"


def test_resolved_prefers_explicit_uri_then_environment(tmp_path: Path) -> None:
    from_env = TrainingConfig().resolved(tmp_path, environ={"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"})
    assert from_env.mlflow_tracking_uri == "http://127.0.0.1:5000"
    explicit = TrainingConfig(mlflow_tracking_uri="sqlite:////x/db").resolved(
        tmp_path, environ={"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}
    )
    assert explicit.mlflow_tracking_uri == "sqlite:////x/db"


def test_s3_settings_come_from_the_aws_environment_when_not_set(tmp_path: Path) -> None:
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000/", "AWS_DEFAULT_REGION": "eu-west-1"}
    resolved = TrainingConfig(storage_path="s3://bucket/prefix").resolved(tmp_path, environ=env)
    assert resolved.storage_path == "s3://bucket/prefix"
    assert (resolved.s3_endpoint_url, resolved.s3_region) == ("http://127.0.0.1:9000", "eu-west-1")
    explicit = TrainingConfig(s3_endpoint_url="https://s3.example.com").resolved(tmp_path, environ=env)
    assert explicit.s3_endpoint_url == "https://s3.example.com"


def test_new_run_keys_are_unique_and_accepted_by_resume() -> None:
    keys = {new_run_key() for _ in range(50)}
    assert len(keys) == 50
    for key in list(keys)[:3]:
        assert TrainingConfig(resume=key).resume == key


def test_public_params_are_flat_strings_or_scalars() -> None:
    params = TrainingConfig(train_config={"hidden_sizes": [32, 16]}).public_params(secret_keys=())
    assert set(params) == set(TrainingConfig.model_fields) | {"train_config.hidden_sizes"}
    assert all(isinstance(v, str | int | float | bool) for v in params.values())


def test_cli_flags_map_to_fields() -> None:
    config = parse_config(["--num-workers", "3", "--epochs", "5", "--no-register", "--learning-rate", "0.01"])
    assert (config.num_workers, config.epochs) == (3, 5)
    assert config.register is False and config.learning_rate == 0.01
    assert parse_config([]) == TrainingConfig()


def test_every_field_has_a_flag() -> None:
    from flows.cli import build_parser

    flags = {option for action in build_parser()._actions for option in action.option_strings}
    for name in TrainingConfig.model_fields:
        assert f"--{name.replace('_', '-')}" in flags


def test_cli_rejects_bad_value_with_exit_2_and_field_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(["--num-workers", "0", "--epochs", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "num_workers (--num-workers)" in err and "epochs (--epochs)" in err


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({}, "ray_address"),  # a local Ray dies with this process: a job there would not outlive it
        ({"ray_address": "ray://head:10001"}, "ray_address"),
        ({"ray_address": "head:6379", "mlflow_tracking_uri": "https://user:pw@mlflow:5000"}, "mlflow_tracking_uri"),
        # Your code's settings are in the entrypoint too, at any depth (they were not checked)
        (
            {"ray_address": "head:6379", "train_config": {"dataset": "s3://k:secret@bucket/data.csv"}},
            "train_config.dataset",
        ),
        (
            {"ray_address": "head:6379", "train_config": {"sources": [{"db": "postgresql://u:secret@db/x"}]}},
            "train_config.sources",
        ),
        ({"ray_address": "head:6379", "train_config": {"dsn": "reader:secret@db:5432/x"}}, "train_config.dsn"),
        ({"ray_address": "head:6379", "train_config": {"rows": "bucket/x.csv?token=secret99"}}, "train_config.rows"),
    ],
)
def test_ray_job_mode_refuses_what_it_cannot_run_or_would_expose(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as info:
        TrainingConfig(launch_mode="ray_job", **settings)
    shown = describe_validation_error(info.value)  # what the CLI prints
    assert f"`{named}`" in shown and "launch_mode" in shown
    assert "pw" not in shown and "secret" not in shown


def test_ray_job_mode_submits_to_the_dashboard_of_the_address_unless_told() -> None:
    assert TrainingConfig(launch_mode="ray_job", ray_address="10.0.0.5:6379").dashboard_url == "http://10.0.0.5:8265"
    told = TrainingConfig(launch_mode="ray_job", ray_address="10.0.0.5:6379", ray_dashboard_url="https://ray.corp/")
    assert told.dashboard_url == "https://ray.corp"


@pytest.mark.parametrize(
    ("settings", "nodes", "streams", "share"),
    [
        # This machine's local Ray: the default is what fits it, with or without a streamed Ray Data pipeline.
        ({}, [{"CPU": 2.0}], False, 1.0),
        ({}, [{"CPU": 2.0}], True, 0.75),
        # Elastic: sized so that the most workers fit.
        ({"max_workers": 4}, [{"CPU": 2.0}], False, 0.5),
        # A worker never spans nodes: two workers on a 4-CPU node beat one there and one on a 1-CPU node.
        ({}, [{"CPU": 4.0}, {"CPU": 1.0}, {"CPU": 1.0}], False, 2.0),
        ({"num_workers": 3}, [{"CPU": 16.0}, {"CPU": 16.0}], False, 8.0),
        # One GPU per worker: the share comes from the nodes that have them.
        ({"use_gpu": True}, [{"CPU": 16.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}], False, 4.0),
        ({"use_gpu": True}, [{"CPU": 16.0, "GPU": 2.0}], False, 8.0),
        # Set by hand: kept as it is, fit or not (the pre-flight says when it does not).
        ({"cpus_per_worker": 1.5}, [{"CPU": 2.0}], True, 1.5),
        # Nothing to size from, or shares under half a CPU: the least share, which the pre-flight refuses
        # (naming the settings) rather than start starved workers.
        ({}, [], False, 0.5),
        ({"num_workers": 8}, [{"CPU": 2.0}], False, 0.5),
    ],
)
def test_cpus_per_worker_unset_is_sized_to_the_cluster(
    settings: dict[str, object], nodes: list[dict[str, float]], streams: bool, share: float
) -> None:
    from raytrain_driver.sizing import check_resources, sized_for_cluster

    config = TrainingConfig.model_validate(settings)
    plan = sized_for_cluster(config, nodes, streams)
    assert plan.cpus_per_worker == share and plan.sized == (not config.cpus_per_worker)
    assert (plan.min_workers, plan.max_workers) == config.worker_range and plan.use_gpu == config.use_gpu
    total = {"CPU": sum(n["CPU"] for n in nodes), "GPU": sum(n.get("GPU", 0.0) for n in nodes)}
    if share * config.num_workers > total["CPU"]:
        with pytest.raises(ClusterError, match="lower `num_workers` or `cpus_per_worker`"):
            check_resources(config, plan, total, streams)
    elif not config.cpus_per_worker:
        check_resources(config, plan, total, streams)  # the pre-flight accepts what it sized


def test_cpus_per_worker_defaults_to_sized_and_is_never_negative() -> None:
    assert TrainingConfig().cpus_per_worker == 0.0
    with pytest.raises(ValidationError):
        TrainingConfig(cpus_per_worker=-1)


@pytest.mark.parametrize(
    ("settings", "earlier", "nodes", "share"),
    [
        # Elastic (1-2 workers), sized at 1 CPU on two 1-CPU nodes; one node is lost and the fit is retried:
        # the same share, so Ray Train starts one worker on the survivor, not two at half a CPU each.
        ({"num_workers": 1, "max_workers": 2}, 1.0, [{"CPU": 1.0}], 1.0),
        # The node is back: still the run's share (two workers fit again).
        ({"num_workers": 1, "max_workers": 2}, 1.0, [{"CPU": 1.0}, {"CPU": 1.0}], 1.0),
        # A fixed count that no longer fits at the earlier share is sized anew (the pre-flight judges the rest).
        ({"num_workers": 2}, 1.0, [{"CPU": 1.0}], 0.5),
        # Not even `num_workers` fits at it, or it is below the least share that is ever sized: sized anew.
        ({"num_workers": 1, "max_workers": 2}, 4.0, [{"CPU": 2.0}], 1.0),
        ({"num_workers": 1, "max_workers": 2}, 0.01, [{"CPU": 2.0}], 1.0),
        # Set by hand: the setting wins.
        ({"cpus_per_worker": 0.5}, 1.0, [{"CPU": 2.0}], 0.5),
    ],
)
def test_a_retried_or_resumed_run_keeps_the_cpus_per_worker_it_trained_with(
    settings: dict[str, object], earlier: float, nodes: list[dict[str, float]], share: float
) -> None:
    from raytrain_driver.sizing import sized_for_cluster

    config = TrainingConfig.model_validate(settings)
    assert sized_for_cluster(config, nodes, streams=False, earlier=earlier).cpus_per_worker == share


def test_ray_datasets_of_the_users_code_get_a_whole_cpu_beside_the_workers() -> None:
    """A TrainFunc with `datasets=`: Ray Data's read and transform tasks ask 1 CPU each by default, so sizing
    leaves one free (two workers at 0.75 CPU on 2 CPUs left 0.5: the tasks never started and the fit hung), and
    a share set by hand that leaves less is refused naming train_code and the settings."""
    from raytrain_driver.sizing import USER_DATASET_CPUS, FitPlan, check_resources, sized_for_cluster

    config = TrainingConfig(train_code="my_model.train:training")
    plan = sized_for_cluster(config, [{"CPU": 2.0}], True, data_cpus=USER_DATASET_CPUS)
    assert plan.cpus_per_worker == 0.5
    check_resources(config, plan, {"CPU": 2.0}, True, user_datasets=True, data_cpus=USER_DATASET_CPUS)
    by_hand = TrainingConfig(train_code="my_model.train:training", cpus_per_worker=0.75)
    with pytest.raises(ClusterError, match=r"my_model.train:training.*datasets=.*`cpus_per_worker`"):
        check_resources(
            by_hand, FitPlan.of(by_hand), {"CPU": 2.0}, True, user_datasets=True, data_cpus=USER_DATASET_CPUS
        )


@pytest.mark.parametrize(
    ("settings", "name"),
    [
        ({}, "digits-classifier"),
        ({"dataset": "synthetic"}, "synthetic-classifier"),
        ({"dataset": "/data/flowers.csv", "label_column": "species"}, "flowers-classifier"),
        ({"dataset": "s3://bucket/raw/churn 2026.parquet"}, "churn-2026-classifier"),
        ({"dataset": "/data/flowers.csv", "model_name": "iris"}, "iris"),
        ({"train_code": "my_model.train:training"}, "my_model.train"),
    ],
)
def test_the_default_model_name_follows_the_users_data_or_code(settings: dict[str, str], name: str) -> None:
    """Left at its default, the registered model is not the digits classifier's for a user's own data or code:
    a version there would stand behind a champion scored on other data and stay `challenger`. The default code,
    the table classifier, names it after its table, through the steps the flow takes."""
    from raytrain_driver.preflight import code_model_name

    config = config_from_parameters(settings)
    code_name = "" if "train_code" in settings else code_model_name(config)
    assert config.resolved(Path("/work"), {}, code_name).model_name == name


def test_a_resume_may_change_what_steers_the_run_and_nothing_it_trains_with() -> None:
    """Which settings a resume may change is declared on each field (one place); the check reads only that."""
    from raytrain_tasks.errors import TrackingError
    from raytrain_tasks.tracking.runs import _check_params_unchanged

    started = TrainingConfig()
    logged = {key: str(value) for key, value in started.public_params(secret_keys=()).items()}
    steering = {"min_improvement": 0.05, "fit_retries": 0, "run_lease_seconds": 60.0, "register": False}
    _check_params_unchanged(logged, TrainingConfig(**steering).public_params(secret_keys=()), "20260101-000000-abcdef")
    changed = TrainingConfig(**steering, learning_rate=0.5, epochs=9)
    with pytest.raises(TrackingError, match=r"other settings \(epochs: '3' -> '9', learning_rate: '\S+' -> '0\.5'\)"):
        _check_params_unchanged(logged, changed.public_params(secret_keys=()), "20260101-000000-abcdef")


def test_a_resume_whose_code_lost_a_default_is_refused() -> None:
    """A default removed from the code left its ``train_config.<key>`` param out of the resume's
    params, and only the keys present were compared: the run went on training without it."""
    from raytrain_tasks.errors import TrackingError
    from raytrain_tasks.tracking.runs import _check_params_unchanged

    config = TrainingConfig(train_code="my.code:training")
    started = config.public_params({"hidden": 32, "dropout": 0.1}, secret_keys=())
    logged = {key: str(value) for key, value in started.items()}
    _check_params_unchanged(
        logged, config.public_params({"hidden": 32, "dropout": 0.1}, secret_keys=()), "20260101-000000-abcdef"
    )
    with pytest.raises(TrackingError, match=r"other settings \(train_config\.dropout: '0\.1' -> '\(none\)'\)"):
        _check_params_unchanged(logged, config.public_params({"hidden": 32}, secret_keys=()), "20260101-000000-abcdef")


def test_an_invalid_train_config_is_named_without_echoing_its_values() -> None:
    """The CLI prints this message: a train_config refused for one key must not show the others (a password,
    a token) in clear. A scalar setting's value is still shown, its credentials masked."""
    with pytest.raises(ValidationError) as info:
        TrainingConfig(train_config={"seed": 1, "db_password": "hunter2-in-clear"})
    shown = describe_validation_error(info.value)
    assert "train_config (--train-config)" in shown and "may not set seed" in shown, shown
    assert "hunter2" not in shown, shown
    with pytest.raises(ValidationError) as info:
        TrainingConfig(storage_path="gs://user:pw-in-clear@bucket/x")
    shown = describe_validation_error(info.value)
    assert "storage_path (--storage-path)" in shown and "pw-in-clear" not in shown, shown
