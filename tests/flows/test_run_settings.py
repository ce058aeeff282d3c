"""A deployment run with some settings changed keeps every other setting of its deployment.

Each training setting is a flow parameter of its own, so the Prefect server's own merge of a run's parameters
into its deployment's (by top-level key) is the merge users expect. Deployments and flow runs of the real
training flow are created in the test Prefect API, as `prefect deploy` and `prefect deployment run -p` /
`--params` / `run_deployment` create them. The end-to-end run of the nightly deployment with one override, by
`serve` on `prefect server`, is in test_prefect_server.py.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.exceptions import PrefectHTTPStatusError, SignatureMismatchError
from prefect.states import Crashed

from flows.continuation import continuation_of
from flows.run_settings import RUN_ENVIRONMENT, check_deployment_pins, refused_environment
from flows.training import training_pipeline
from raytrain_tasks.config import TrainingConfig, config_from_parameters, non_default_settings, parameters_of
from raytrain_tasks.errors import SettingsError

pytestmark = pytest.mark.usefixtures("prefect_api")

NIGHTLY = {
    "train_config": {"dataset": "synthetic"},
    "num_workers": 2,
    "epochs": 10,
    "model_name": "nightly-model",
    "min_improvement": 0.002,
}


def _deployment(parameters: dict[str, Any], job_variables: dict[str, Any] | None = None) -> UUID:
    """The training flow deployed as `prefect deploy` does it: its parameter schema enforced by the server."""
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(training_pipeline)
        return client.create_deployment(
            flow_id=flow_id,
            name="nightly",
            parameters=parameters,
            parameter_openapi_schema=training_pipeline.parameters.model_dump(),
            enforce_parameter_schema=True,
            job_variables=job_variables,
        )


def _trigger(deployment_id: UUID, parameters: dict[str, Any], state: Any = None, **options: Any) -> Any:
    with get_client(sync_client=True) as client:
        return client.create_flow_run_from_deployment(deployment_id, parameters=parameters, state=state, **options)


def _trained_with(flow_run: Any) -> TrainingConfig:
    """What the flow trains with for this run: Prefect's validation of the stored parameters, then the flow's."""
    return config_from_parameters(training_pipeline.validate_parameters(flow_run.parameters))


def test_a_run_with_one_override_keeps_the_deployments_other_settings() -> None:
    deployment = _deployment(NIGHTLY)
    flow_run = _trigger(deployment, {"epochs": 3})  # -p epochs=3, --params '{"epochs": 3}', run_deployment
    config = _trained_with(flow_run)
    assert config.epochs == 3
    assert config.min_improvement == 0.002 and config.model_name == "nightly-model"
    assert config.train_config == {"dataset": "synthetic"} and config.num_workers == 2
    assert config.batch_size == TrainingConfig().batch_size  # set by neither: the default


def test_a_run_that_sets_nothing_trains_with_the_deployments_settings_and_the_whole_form_wins() -> None:
    deployment = _deployment(NIGHTLY)
    assert _trained_with(_trigger(deployment, {})) == TrainingConfig.model_validate(NIGHTLY)

    # The UI's custom-run form sends every field: the run gets exactly what it sent.
    whole = parameters_of(TrainingConfig.model_validate({**NIGHTLY, "min_improvement": 0.0}))
    config = _trained_with(_trigger(deployment, whole))
    assert config.min_improvement == 0.0 and config.epochs == 10


def test_train_config_is_a_json_object_as_prefects_p_and_the_form_send_it() -> None:
    """`prefect deployment run ... -p 'train_config={"hidden": 64}'` (Prefect's -p reads a value as JSON) and the
    UI's JSON editor send an object. The parameter was a string: the server refused the object (422), and the
    guide had users quote the JSON twice."""
    deployment = _deployment({**NIGHTLY, "train_code": "examples.seed_ddp.train:training"})
    config = _trained_with(_trigger(deployment, {"train_config": {"hidden": 64, "layers": [2, 3]}}))
    assert config.train_config == {"hidden": 64, "layers": [2, 3]}
    assert config.public_params(secret_keys=())["train_config.hidden"] == 64
    # A run stored with the text form (before train_config was an object) passes Prefect's own check of its
    # parameters and trains with the object; a cleared form field is an empty one.
    stored = training_pipeline.validate_parameters({"train_config": '{"hidden": 64}'})
    assert config_from_parameters(stored).train_config == {"hidden": 64}
    assert config_from_parameters(training_pipeline.validate_parameters({"train_config": None})).train_config == {}


def test_the_server_refuses_an_invalid_value_before_a_run_exists() -> None:
    deployment = _deployment(NIGHTLY)
    with get_client(sync_client=True) as client:
        before = len(client.read_flow_runs())
        with pytest.raises(PrefectHTTPStatusError, match="409|422") as refused:
            _trigger(deployment, {"num_workers": 0})
        assert "num_workers" in refused.value.response.text
        assert len(client.read_flow_runs()) == before


def test_settings_the_fields_allow_but_the_config_does_not_fail_naming_them() -> None:
    """Rules across fields are not in the form's schema: the flow refuses them before anything starts."""
    flow_run = _trigger(_deployment(NIGHTLY), {"num_workers": 3, "max_workers": 2})
    with pytest.raises(SettingsError, match=r"max_workers \(2\) must be 0 \(fixed size\) or at least num_workers"):
        _trained_with(flow_run)


def test_a_deployment_still_giving_the_table_classifiers_old_settings_is_refused_naming_them() -> None:
    """A deployment made before `dataset`, `hidden_sizes`, ... moved into the table classifier's train_config: its
    runs fail Prefect's own check, naming them, before anything starts (CHANGELOG.md says how they map)."""
    with pytest.raises(SignatureMismatchError, match="'dataset'"):
        training_pipeline.validate_parameters({"dataset": "customers.csv", "epochs": 3})


def test_the_old_single_config_parameter_is_refused_not_dropped() -> None:
    """`--params '{"config": {...}}'` (the form before settings were parameters) must not train on defaults."""
    with pytest.raises(SignatureMismatchError, match="config"):
        training_pipeline.validate_parameters({"config": {"epochs": 3}})
    with pytest.raises(SettingsError, match="one `config` parameter"):
        config_from_parameters({"config": {"epochs": 3}})


def test_the_log_line_names_what_differs_from_the_defaults_without_credentials() -> None:
    config = TrainingConfig(epochs=5, mlflow_tracking_uri="http://admin:s3cret@127.0.0.1:5000")
    line = non_default_settings(config, ())
    assert "epochs=5" in line and "s3cret" not in line and "127.0.0.1:5000" in line
    assert non_default_settings(TrainingConfig(), ()) == ""


def test_a_crashed_run_with_an_override_is_continued_with_the_deployments_other_settings() -> None:
    deployment = _deployment(NIGHTLY)
    crashed = _trigger(deployment, {"epochs": 4}, state=Crashed())
    with get_client(sync_client=True) as client:
        client.update_flow_run(crashed.id, tags=["run-key:20261123-120000-abcdef"])
    continuation = continuation_of(f"prefect.flow-run.{crashed.id}")
    assert continuation.config.epochs == 4
    assert continuation.config.min_improvement == 0.002 and continuation.config.model_name == "nightly-model"
    assert continuation.config.resume == "20261123-120000-abcdef"


def test_a_run_may_not_point_the_deployments_credentials_elsewhere() -> None:
    """Whoever may only trigger runs (the UI's custom run, `-p`, `--job-variable`) must not send the worker's
    MLflow, S3 or Ray credentials to a server of their own: the settings that say where they go, and the
    environment variables they fall back to, are the deployment's."""
    own = {**NIGHTLY, "mlflow_tracking_uri": "http://mlflow.internal:5000", "s3_endpoint_url": "http://s3.internal/"}
    deployment = _deployment(own)
    with get_client(sync_client=True) as client:
        name = client.read_deployment(deployment).name

    def check(flow_run: Any) -> None:
        check_deployment_pins(_trained_with(flow_run), str(deployment), str(flow_run.id))

    check(_trigger(deployment, {"epochs": 3}))  # other settings change; a trailing slash stored is the same URL
    check(_trigger(deployment, parameters_of(TrainingConfig.model_validate({**own, "epochs": 4}))))  # the UI form
    check(_trigger(deployment, {}, job_variables={"env": {"OMP_NUM_THREADS": "2"}}))

    for override in (
        {"mlflow_tracking_uri": "http://collector.example:5000"},
        {"ray_address": "collector.example:6379", "forward_credentials_to_cluster": True},
        {"s3_endpoint_url": "http://collector.example:9000"},
    ):
        with pytest.raises(SettingsError) as refused:
            check(_trigger(deployment, override))
        assert f"run of deployment {name!r} has {', '.join(override)} other than its" in str(refused.value)
        assert "collector.example" not in str(refused.value)
    # A key of train_config named as a pinned setting: the table classifier reads an s3:// table through its own
    # s3_endpoint_url, with the worker's AWS keys. It keeps the deployment's train_config value (none here).
    with pytest.raises(SettingsError, match=r"has train_config\.s3_endpoint_url other than its") as refused:
        check(_trigger(deployment, {"train_config": {"s3_endpoint_url": "http://collector.example:9000"}}))
    assert "collector.example" not in str(refused.value)
    check(_trigger(deployment, {"train_config": {"dataset": "s3://tables/customers.csv"}}))  # other keys: free
    with pytest.raises(SettingsError, match="sets MLFLOW_TRACKING_URI in its job variables"):
        check(_trigger(deployment, {}, job_variables={"env": {"MLFLOW_TRACKING_URI": "http://collector.example"}}))
    assert check_deployment_pins(_trained_with(_trigger(deployment, {})), None) is None  # a run of no deployment


def test_a_deployment_that_cannot_be_read_refuses_the_run() -> None:
    deployment = _deployment(NIGHTLY)
    config = _trained_with(_trigger(deployment, {}))
    with get_client(sync_client=True) as client:
        client.delete_deployment(deployment)
    with pytest.raises(SettingsError, match="no longer exists, so the settings it pins .* nothing was started"):
        check_deployment_pins(config, str(deployment))


@pytest.mark.parametrize(
    ("run_env", "deployment_env", "refused"),
    [
        ({}, {}, []),
        ({"OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, {}, []),
        ({"MLFLOW_REGISTRY_URI": "http://collector.example"}, {}, ["MLFLOW_REGISTRY_URI"]),
        # Proxies (both spellings, which requests and botocore read), CA bundles, TLS switches: every one refused.
        (
            {name: "x" for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY")},
            {},
            ["ALL_PROXY", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "https_proxy"],
        ),
        (
            {
                "REQUESTS_CA_BUNDLE": "/tmp/ca.pem",
                "SSL_CERT_FILE": "/tmp/ca.pem",
                "MLFLOW_TRACKING_INSECURE_TLS": "true",
            },
            {},
            ["MLFLOW_TRACKING_INSECURE_TLS", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"],
        ),
        # What the pinned settings fall back to, where S3, Ray and Prefect are, and what code loads.
        (
            {"AWS_ENDPOINT_URL": "x", "AWS_PROFILE": "x", "RAY_ADDRESS": "x", "PREFECT_API_URL": "x"},
            {},
            ["AWS_ENDPOINT_URL", "AWS_PROFILE", "PREFECT_API_URL", "RAY_ADDRESS"],
        ),
        (
            {"PYTHONPATH": "/tmp", "LD_PRELOAD": "x.so", "NCCL_NET_PLUGIN": "x"},
            {},
            ["LD_PRELOAD", "NCCL_NET_PLUGIN", "PYTHONPATH"],
        ),
        # The deployment's own value sent back (a form that starts from the deployment's job variables) changes
        # nothing; another value, or unsetting it, is refused.
        ({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}, {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}, []),
        ({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": 30}, {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}, []),
        (
            {"MLFLOW_TRACKING_URI": "http://collector"},
            {"MLFLOW_TRACKING_URI": "http://mlflow"},
            ["MLFLOW_TRACKING_URI"],
        ),
        ({"REQUESTS_CA_BUNDLE": None}, {"REQUESTS_CA_BUNDLE": "/etc/ca.pem"}, ["REQUESTS_CA_BUNDLE"]),
        ({"OMP_NUM_THREADS": "8"}, {"OMP_NUM_THREADS": "2"}, []),
    ],
)
def test_a_runs_job_variables_may_set_only_the_environment_the_allow_list_names(
    run_env: dict[str, Any], deployment_env: dict[str, Any], refused: list[str]
) -> None:
    assert refused_environment(run_env, deployment_env) == refused


def test_no_variable_that_points_traffic_elsewhere_is_on_the_allow_list() -> None:
    prefixes = ("MLFLOW_", "AWS_", "RAY_", "PREFECT_", "HTTP", "SSL_", "REQUESTS_", "CURL_", "LD_", "GRPC_")
    assert not [name for name in RUN_ENVIRONMENT if name.upper().startswith(prefixes) or "PROXY" in name.upper()]
    assert not {"PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "CUDA_VISIBLE_DEVICES"} & RUN_ENVIRONMENT


def test_a_run_may_not_redirect_mlflows_registry_or_weaken_tls_through_its_job_variables() -> None:
    """`--job-variable env=...` or the custom run's job variables: MLflow would send every registry call, with the
    worker's MLflow credentials, to MLFLOW_REGISTRY_URI though the deployment pins mlflow_tracking_uri."""
    deployment = _deployment(NIGHTLY, job_variables={"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}})
    with get_client(sync_client=True) as client:
        name = client.read_deployment(deployment).name

    def check(env: dict[str, Any]) -> None:
        flow_run = _trigger(deployment, {}, job_variables={"env": env})
        check_deployment_pins(_trained_with(flow_run), str(deployment), str(flow_run.id))

    check({"OMP_NUM_THREADS": "2", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"})
    for env in (
        {"MLFLOW_REGISTRY_URI": "http://collector.example:5000"},
        {"HTTPS_PROXY": "http://collector.example:3128", "OMP_NUM_THREADS": "2"},
        {"MLFLOW_TRACKING_INSECURE_TLS": "true"},
        {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "600"},
    ):
        with pytest.raises(SettingsError) as refused:
            check(env)
        names = sorted(set(env) - RUN_ENVIRONMENT)
        assert f"run of deployment {name!r} sets {', '.join(names)} in its job variables" in str(refused.value)
        assert "Nothing was started" in str(refused.value) and "collector.example" not in str(refused.value)
