"""deployments/prefect.yaml: every entrypoint imports and every deployment's parameters fit the flow's schema."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from prefect.flows import load_flow_from_entrypoint

from deployments.serve import PREFECT_YAML, build_deployments, load_deployment_specs
from raytrain_driver.origin import ENTRY_POINT
from raytrain_tasks.config import TrainingConfig, config_from_parameters
from tests.helpers import REPO_ROOT

SPECS = load_deployment_specs()
TRAINING = [spec for spec in SPECS if spec["entrypoint"] == ENTRY_POINT]  # the others: test_rollback_deployment...


@pytest.mark.parametrize("spec", TRAINING, ids=[s["name"] for s in TRAINING])
def test_entrypoint_imports_and_parameters_validate(spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # prefect deploy runs from the repository root
    flow = load_flow_from_entrypoint(spec["entrypoint"])
    validated = flow.validate_parameters(spec.get("parameters") or {})
    assert config_from_parameters(validated) == TrainingConfig.model_validate(spec.get("parameters") or {})
    assert spec["work_pool"]["name"] == "raytrain-process"


def test_rollback_deployment_has_a_typed_form_and_refuses_what_is_not_a_rollback() -> None:
    """The UI's run form of `rollback-champion`: the model, the version and the reason, required and typed; the
    server refuses a run without them, or with a version that cannot exist, before it starts."""
    (spec,) = [spec for spec in SPECS if spec["name"] == "rollback-champion"]
    assert spec["work_pool"]["name"] == "raytrain-process" and not spec.get("schedules") and not spec.get("parameters")
    flow = load_flow_from_entrypoint(f"{REPO_ROOT}/{spec['entrypoint']}")
    schema = flow.parameters.model_dump()
    fields = schema["properties"]
    assert list(fields) == ["model_name", "to_version", "reason", "mlflow_tracking_uri"]
    assert schema["required"] == ["model_name", "to_version", "reason"]
    assert fields["to_version"]["type"] == "integer" and fields["to_version"]["minimum"] == 1
    assert fields["model_name"]["pattern"] and fields["reason"]["minLength"] == 1
    assert all(field.get("description") for field in fields.values())
    run = {"model_name": "digits-classifier", "to_version": 3, "reason": "v4 mislabels returns"}
    assert flow.validate_parameters(run)["to_version"] == 3
    for refused in ({**run, "to_version": 0}, {**run, "reason": ""}, {**run, "model_name": "it's"}, {"to_version": 3}):
        with pytest.raises(Exception, match="model_name|to_version|reason"):
            flow.validate_parameters(refused)


def test_the_scoring_deployment_has_a_typed_form_that_asks_for_the_table_and_the_output() -> None:
    """The UI's run form of `score-champion`: the champion by default; the input and the output required; a run
    without them, or out of bounds, refused by the server before it starts."""
    from raytrain_tasks.scoring.config import ScoringConfig

    (spec,) = [spec for spec in SPECS if spec["name"] == "score-champion"]
    assert spec["parameters"] == {"model": "models:/digits-classifier@champion"} and not spec.get("schedules")
    flow = load_flow_from_entrypoint(f"{REPO_ROOT}/{spec['entrypoint']}")
    schema = flow.parameters.model_dump()
    assert list(schema["properties"]) == list(ScoringConfig.model_fields)  # one field per setting, in order
    assert schema["required"] == ["model", "input_path", "output_path"]
    assert all(field.get("description") for field in schema["properties"].values())
    run = {**spec["parameters"], "input_path": "s3://tables/today/", "output_path": "s3://scores/today.parquet"}
    assert ScoringConfig(**flow.validate_parameters(run)).concurrency == 2
    assert schema["properties"]["concurrency"]["type"] == "integer"
    for refused in ({**run, "concurrency": 0}, {**run, "output_path": ""}, {"model": run["model"]}):
        with pytest.raises(Exception, match="concurrency|output_path|input_path"):
            flow.validate_parameters(refused)


def test_the_sweep_deployment_has_every_setting_and_the_search_in_its_form() -> None:
    """The UI's run form of `sweep`: every training setting (the trials' settings), then the search, the trials,
    ASHA's grace period and the key of a sweep to continue; the deployment's search is one the sweep accepts."""
    from raytrain_driver.sweep_run import plan_search

    (spec,) = [spec for spec in SPECS if spec["name"] == "sweep"]
    flow = load_flow_from_entrypoint(f"{REPO_ROOT}/{spec['entrypoint']}")
    schema = flow.parameters.model_dump()
    assert list(schema["properties"]) == [*TrainingConfig.model_fields, "search", "trials", "grace_period", "sweep_key"]
    assert schema["required"] == ["search"] and schema["properties"]["trials"]["minimum"] == 1
    validated = flow.validate_parameters(spec["parameters"])
    assert len(plan_search(config_from_parameters(validated), validated["search"])) == 2
    with pytest.raises(Exception, match="trials"):
        flow.validate_parameters({**spec["parameters"], "trials": 0})


def test_a_nightly_schedule_with_timezone_and_an_unscheduled_ad_hoc_deployment() -> None:
    by_name = {spec["name"]: spec for spec in SPECS}
    (schedule,) = by_name["nightly-retrain"]["schedules"]
    assert schedule == {"cron": "0 2 * * *", "timezone": "Europe/Berlin"}
    assert not by_name["ad-hoc"].get("schedules")
    assert "definitions:" in PREFECT_YAML.read_text()  # shared settings live under YAML anchors


def test_invalid_values_are_rejected_before_a_run_starts() -> None:
    flow = load_flow_from_entrypoint(f"{REPO_ROOT}/flows/training.py:training_pipeline")
    with pytest.raises(Exception, match="num_workers"):
        flow.validate_parameters({"num_workers": 0})


def test_parameter_form_is_typed_and_described() -> None:
    flow = load_flow_from_entrypoint(f"{REPO_ROOT}/flows/training.py:training_pipeline")
    schema = flow.parameters.model_dump()
    fields = schema["properties"]
    # One parameter per setting, in the config's order, then the crash trigger's; none required.
    assert list(fields) == [*TrainingConfig.model_fields, "continue_flow_run"]
    assert not schema.get("required")
    assert all(field.get("title") and field.get("description") for field in fields.values())
    assert fields["num_workers"]["title"] == "Workers" and fields["epochs"]["default"] == 3
    assert fields["launch_mode"]["enum"] == ["driver", "ray_job"]
    # The form is the run's: the table classifier's settings are its own, in train_config.
    assert not {"dataset", "label_column", "hidden_sizes", "data_loader", "promotion_metric"} & set(fields)
    assert fields["num_workers"]["minimum"] == 1 and fields["learning_rate"]["exclusiveMinimum"] == 0


def test_serve_builds_the_same_deployments() -> None:
    deployments = {d.name: d for d in build_deployments(SPECS)}
    assert set(deployments) == {"nightly-retrain", "ad-hoc", "rollback-champion", "score-champion", "sweep"}
    assert deployments["sweep"].flow_name == "sweep"
    assert deployments["score-champion"].flow_name == "score"
    rollback = deployments["rollback-champion"]
    assert rollback.flow_name == "rollback-champion" and not rollback.schedules
    (schedule,) = deployments["nightly-retrain"].schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "Europe/Berlin"
    assert not deployments["ad-hoc"].schedules
    assert not deployments["ad-hoc"].parameters  # the flow's defaults, in the form and in every run
    assert deployments["nightly-retrain"].parameters == {"epochs": 10, "min_improvement": 0.002}


@pytest.mark.parametrize("spec", TRAINING, ids=[s["name"] for s in TRAINING])
def test_a_deployment_states_only_what_differs_from_the_defaults(spec: dict[str, Any]) -> None:
    """A default declared a second time in prefect.yaml would stop following the config's when that changes."""
    defaults = TrainingConfig()
    stated = spec.get("parameters") or {}
    repeated = {name: value for name, value in stated.items() if getattr(defaults, name) == value}
    assert not repeated, f"{spec['name']} repeats defaults of raytrain_tasks/config.py: {repeated}"


@pytest.mark.parametrize("spec", TRAINING, ids=[s["name"] for s in TRAINING])
def test_each_deployment_continues_its_own_crashed_runs(spec: dict[str, Any]) -> None:
    """The crash trigger reacts to Crashed runs of this deployment only (another deployment's crash must not
    start this one) and hands the crashed run to the flow's `continue_flow_run`, which the flow accepts."""
    (trigger,) = spec["triggers"]
    assert trigger["expect"] == ["prefect.flow-run.Crashed"] and trigger["enabled"]
    assert trigger["match_related"] == {"prefect.resource.role": "deployment", "prefect.resource.name": spec["name"]}
    assert trigger["parameters"] == {"continue_flow_run": "{{ event.resource.id }}"}
    flow = load_flow_from_entrypoint(f"{REPO_ROOT}/{spec['entrypoint']}")
    assert flow.validate_parameters({"continue_flow_run": "prefect.flow-run.x"})["continue_flow_run"]
    (deployment,) = build_deployments([spec])
    assert deployment.triggers[0].model_dump()["match_related"] == trigger["match_related"]  # `make serve` too


@pytest.mark.parametrize("spec", TRAINING, ids=[s["name"] for s in TRAINING])
def test_runs_under_the_zombie_watch_send_heartbeats_often_enough(spec: dict[str, Any]) -> None:
    """The tag puts a deployment's runs under the 120 s no-heartbeat watch; its runs must then beat every 30 s."""
    from flows.continuation import HEARTBEAT_SECONDS, HEARTBEAT_TAG, SILENCE_SECONDS

    assert HEARTBEAT_TAG in spec["tags"]
    env = spec["work_pool"]["job_variables"]["env"]
    assert int(env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) == HEARTBEAT_SECONDS <= SILENCE_SECONDS / 3


def test_the_served_deployments_end_paused_whatever_stopped_serving(
    prefect_api: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefect's runner pauses what it served on a clean stop, but its SIGTERM path (sys.exit in the handler)
    now and then never gets the pause to the server; deployments.serve pauses them itself once serving ends."""
    import prefect
    from prefect.client.orchestration import get_client

    from deployments import serve

    def serve_until_sigterm(*deployments: Any, **runner_options: Any) -> None:
        for deployment in deployments:
            deployment.apply()  # registered and scheduled, as serve does
        raise SystemExit(0)  # what the runner's SIGTERM handler raises; here before its own pause ran

    monkeypatch.setattr(prefect, "serve", serve_until_sigterm)
    monkeypatch.setenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30")  # what serve sets, as it was after the test
    with pytest.raises(SystemExit):
        serve.main(["--no-warm-ray"])  # the warm Ray: test_prefect_server.py
    with get_client(sync_client=True) as client:
        for name in ("nightly-retrain", "ad-hoc"):
            assert client.read_deployment_by_name(f"training-pipeline/{name}").paused, name
        assert client.read_deployment_by_name("rollback-champion/rollback-champion").paused


def test_serve_refuses_a_prefect_file_it_cannot_serve_before_touching_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--prefect-file` of one's own: a missing file, or a deployment whose train_code does not import, ends serve
    at once (exit 2, naming the file and the problem), before it asks any Prefect server for anything."""
    from deployments.serve import main

    assert main(["--prefect-file", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no deployments: list to serve" in capsys.readouterr().err
    broken = tmp_path / "mine.yaml"
    broken.write_text("deployments:\n  - name: mine\n    parameters: {train_code: 'no_such_package.train:training'}\n")
    assert main(["--prefect-file", str(broken)]) == 2
    assert "no module named 'no_such_package'" in capsys.readouterr().err


def _the_guides_deployments_file(train_code: str) -> str:
    """docs/own-model.md's my-deployments.yaml, as a newcomer copies it, naming ``train_code``."""
    guide = (REPO_ROOT / "docs" / "own-model.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", guide, flags=re.DOTALL) if "# my-deployments.yaml" in b]
    return textwrap.dedent(block).replace("my_images.train:training", train_code)


def test_the_guides_deployments_file_served_continues_crashed_runs_and_sends_their_heartbeats(
    prefect_api: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of one's own, copied from docs/own-model.md, served: its deployment is watched for lost runs and
    continues crashed ones (its tag and its trigger), and its runs send the heartbeats the watch needs. A newcomer
    who copied only the tag and the trigger of deployments/prefect.yaml got runs that failed as they started
    ("tagged 'heartbeats-30s' ... but sends heartbeats every 180 s")."""
    import prefect

    from deployments import serve
    from flows.continuation import HEARTBEAT_SECONDS, HEARTBEAT_TAG

    own = tmp_path / "my-deployments.yaml"
    own.write_text(_the_guides_deployments_file("examples.diabetes_regression.train:training"))
    monkeypatch.chdir(REPO_ROOT)  # where `examples` imports from, as the user's package from their folder
    # Prefect's default (every 180 s) here; removed again after the test whatever serve set
    monkeypatch.setenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "")
    monkeypatch.delenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY")
    served: dict[str, Any] = {}

    def serve_and_stop(*deployments: Any, **runner_options: Any) -> None:
        for deployment in deployments:
            deployment.apply()
        served.update(deployments=deployments, heartbeat=os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY"))

    monkeypatch.setattr(prefect, "serve", serve_and_stop)
    assert serve.main(["--prefect-file", str(own), "--no-warm-ray"]) == 0
    (deployment,) = served["deployments"]
    assert HEARTBEAT_TAG in deployment.tags and served["heartbeat"] == str(HEARTBEAT_SECONDS)
    (trigger,) = deployment.triggers
    assert trigger.expect == {"prefect.flow-run.Crashed"}
    assert trigger.match_related.get("prefect.resource.name") == [deployment.name]  # its own runs, none other


def test_serve_refuses_a_deployment_watched_for_heartbeats_it_would_not_send(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment tagged heartbeats-30s whose env sets a slower heartbeat: its live runs would be set Crashed
    by the watch. serve refuses the file at once (exit 2), naming the deployment and the setting to change."""
    import prefect

    from deployments.serve import main

    def never(*deployments: Any, **runner_options: Any) -> None:
        raise AssertionError("serve started serving a file it should have refused")

    monkeypatch.setattr(prefect, "serve", never)
    monkeypatch.setattr("deployments.serve.work_pool_deployments", never)  # nor asked the server anything

    spec = (
        "deployments:\n  - name: slow-beats\n    tags: [heartbeats-30s]\n"
        "    work_pool: {job_variables: {env: {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: '180'}}}\n"
    )
    (tmp_path / "mine.yaml").write_text(spec)
    assert main(["--prefect-file", str(tmp_path / "mine.yaml")]) == 2
    err = capsys.readouterr().err
    assert "slow-beats is tagged 'heartbeats-30s'" in err, err
    assert "job_variables.env of deployment 'slow-beats' sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY='180'" in err
