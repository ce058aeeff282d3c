"""Serve the deployments of deployments/prefect.yaml (training, scoring with the champion, and moving a champion
back) from this one process, schedules included.

    python -m deployments.serve [--replace] [--prefect-file my-deployments.yaml]   # needs PREFECT_API_URL set

For users without a work pool. While it runs, scheduled runs and runs triggered from the UI execute here.
When it stops, Prefect pauses its deployments and drops their scheduled runs (none pile up); serving again
resumes them. Served deployments have the same names as those `prefect deploy` makes for the work pool; a
server holds one or the other, and `--replace` deletes work-pool ones before serving.

Runs with an empty `ray_address` train on one local Ray that this process keeps warm: its start and stop are
paid once, not per run, and it stops with this process. `--no-warm-ray` gives each run a Ray of its own instead
(no Ray processes between runs). A run triggered from the UI starts within RUNNER_POLL_S.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from flows.continuation import HEARTBEAT_SECONDS, HEARTBEAT_TAG, ensure_zombie_automation
from flows.training import training_pipeline
from raytrain_driver.cluster import warm_ray
from raytrain_driver.origin import ENTRY_POINT
from raytrain_tasks.errors import UserCodeError

PREFECT_YAML = Path(__file__).with_name("prefect.yaml")
# How often serving asks the server for runs to start, unless PREFECT_RUNNER_POLL_FREQUENCY says (Prefect's
# default, 10 s, was on average 5 s of every triggered run's wait; one small query per poll).
RUNNER_POLL_S = 1.0


def load_deployment_specs(path: Path = PREFECT_YAML) -> list[dict[str, Any]]:
    """The `deployments:` entries of prefect.yaml, with YAML anchors resolved."""
    return list(yaml.safe_load(path.read_text())["deployments"])


def flow_of(spec: dict[str, Any]) -> Any:
    """The flow a deployment runs: its entrypoint's (this project's flows by module, wherever serve starts); the
    training pipeline's where it names none (a file of one's own that sets only parameters)."""
    import importlib

    from prefect.flows import load_flow_from_entrypoint

    entrypoint = spec.get("entrypoint") or ENTRY_POINT
    path, _, name = entrypoint.rpartition(":")
    if (PREFECT_YAML.parents[1] / path).is_file():
        return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)
    return load_flow_from_entrypoint(entrypoint)


def build_deployments(specs: list[dict[str, Any]]) -> list[Any]:
    from prefect.events import DeploymentEventTrigger
    from prefect.schedules import Cron

    deployments = []
    for spec in specs:
        schedules = [Cron(s["cron"], timezone=s.get("timezone")) for s in spec.get("schedules") or []]
        deployments.append(
            flow_of(spec).to_deployment(
                name=spec["name"],
                description=spec.get("description"),
                tags=spec.get("tags"),
                parameters=spec.get("parameters"),
                schedules=schedules or None,
                triggers=[DeploymentEventTrigger(**trigger) for trigger in spec.get("triggers") or []],
            )
        )
        code_form(deployments[-1], (spec.get("parameters") or {}).get("train_code"))
    return deployments


def code_form(deployment: Any, train_code: str | None) -> None:
    """A deployment that names ``train_code`` whose code declares ``settings=``: its run form's ``train_config`` is
    one typed field per setting, with its default, and the server refuses a run whose train_config does not fit."""
    if not train_code:
        return
    from raytrain_tasks.code_settings import form_schema
    from raytrain_tasks.user_code import resolve

    settings = resolve(train_code).settings
    if settings is None:
        return
    schema = deployment._parameter_openapi_schema  # what `prefect deploy` sets too (prefect/cli/deploy/_core.py)
    form = form_schema(settings)
    schema.definitions = {**(schema.definitions or {}), **form.pop("definitions", {})}
    schema.properties["train_config"] = form | {"position": schema.properties["train_config"].get("position")}
    # The form is this code's: a run may not point the deployment at other code (as Prefect's freeze() marks it).
    schema.properties["train_code"] |= {"readOnly": True, "enum": [train_code]}


def work_pool_deployments(full_names: list[str]) -> list[str]:
    """Which of these deployments (``flow/deployment``) already exist on the server bound to a work pool (made by
    `prefect deploy`)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    found = []
    with get_client(sync_client=True) as client:
        for full_name in full_names:
            try:
                deployment = client.read_deployment_by_name(full_name)
            except ObjectNotFound:
                continue
            if deployment.work_pool_name:
                found.append(full_name)
    return found


def delete_deployments(full_names: list[str]) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for full_name in full_names:
            client.delete_deployment(client.read_deployment_by_name(full_name).id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--replace", action="store_true", help="delete deployments of the same names that a work pool runs"
    )
    parser.add_argument(
        "--no-warm-ray",
        action="store_true",
        help="each run starts and stops a local Ray of its own (no Ray processes between runs) instead of joining "
        "the one serving keeps warm",
    )
    parser.add_argument(
        "--prefect-file",
        type=Path,
        default=PREFECT_YAML,
        help="the deployments to serve: a prefect.yaml of your own, e.g. in your project folder, whose deployments "
        "name your train_code (default: this project's deployments/prefect.yaml)",
    )
    args = parser.parse_args(argv)
    try:
        specs = load_deployment_specs(args.prefect_file)
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        print(f"error: --prefect-file {args.prefect_file}: no deployments: list to serve ({exc})", file=sys.stderr)
        return 2
    try:
        environment = served_environment(specs, os.environ)
        deployments = build_deployments(specs)
    except (UserCodeError, ValueError) as exc:  # a deployment's train_code, imported for its form; its heartbeats
        print(f"error: --prefect-file {args.prefect_file}: {exc}", file=sys.stderr)
        return 2
    full_names = [f"{deployment.flow_name}/{deployment.name}" for deployment in deployments]
    taken = work_pool_deployments(full_names)
    if taken and not args.replace:
        print(
            f"error: {', '.join(taken)} already exist(s) on this server for a work pool (made by `prefect deploy`);"
            " serving would take them over and their worker could no longer run them. Pass --replace to delete"
            " them and serve instead, or keep using the work pool.",
            file=sys.stderr,
        )
        return 2
    if taken:
        delete_deployments(taken)
        print(f"deleted work-pool deployments {', '.join(taken)}", file=sys.stderr)

    from prefect import serve

    # Served runs are child processes of this one: they get the environment the work pool gives its runs
    # (the heartbeat frequency that the zombie-run watch relies on).
    os.environ.update(environment)
    ensure_zombie_automation(training_pipeline.name)
    poll = None if "PREFECT_RUNNER_POLL_FREQUENCY" in os.environ else RUNNER_POLL_S
    with contextlib.ExitStack() as stack:
        if not args.no_warm_ray:
            address = stack.enter_context(warm_ray())
            print(f"runs with an empty ray_address train on the warm local Ray at {address}", file=sys.stderr)
        try:
            serve(*deployments, query_seconds=poll)
        finally:
            pause_served(full_names)
    return 0


HEARTBEAT_SETTING = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"


def served_environment(specs: list[dict[str, Any]], environ: Mapping[str, str]) -> dict[str, str]:
    """What serving adds to its environment for the runs it starts (its children, which share it): each
    deployment's ``work_pool.job_variables.env``, as a work pool would give its runs, and a heartbeat every
    ``HEARTBEAT_SECONDS`` where a deployment is tagged ``HEARTBEAT_TAG`` and nothing sets the frequency (a file of
    one's own that copied the tag and the crash trigger, not the env: every run would fail as it starts).
    ValueError, naming the deployments and where the value comes from, where the runs of one tagged so would
    send heartbeats at another frequency: the zombie watch would set its live runs Crashed."""
    environment: dict[str, str] = {}
    source: dict[str, str] = {}
    for spec in specs:
        env = ((spec.get("work_pool") or {}).get("job_variables") or {}).get("env") or {}
        environment.update({name: str(value) for name, value in env.items()})
        source.update(dict.fromkeys(env, f"the work_pool.job_variables.env of deployment {spec.get('name')!r}"))
    tagged = [str(spec.get("name")) for spec in specs if HEARTBEAT_TAG in (spec.get("tags") or [])]
    every = environment.get(HEARTBEAT_SETTING, environ.get(HEARTBEAT_SETTING))
    if not tagged:
        return environment
    if every is None:
        environment[HEARTBEAT_SETTING] = str(HEARTBEAT_SECONDS)
    elif every.strip() != str(HEARTBEAT_SECONDS):
        raise ValueError(
            f"{', '.join(tagged)} {'is' if len(tagged) == 1 else 'are'} tagged {HEARTBEAT_TAG!r} (a run is set "
            f"Crashed when its heartbeats stop), but {source.get(HEARTBEAT_SETTING, 'the environment serve runs in')} "
            f"sets {HEARTBEAT_SETTING}={every!r} for every run serve starts: set it to {HEARTBEAT_SECONDS} there or "
            "leave it unset, or remove the tag"
        )
    return environment


def pause_served(full_names: list[str]) -> None:
    """Pause the served deployments once serving has stopped, whatever stopped it.

    Prefect's runner pauses them itself on a clean shutdown, but on SIGTERM its pause runs while asyncio cancels
    the runner's tasks, and now and then it never reaches the server (seen in CI: the nightly still scheduled
    30 s after serve exited). With nobody serving them, a paused deployment is the safe state: no scheduled run
    piles up waiting for a process that is gone. Pausing twice is harmless.
    """
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for full_name in full_names:
            deployment = client.read_deployment_by_name(full_name)
            if not deployment.paused:
                client.pause_deployment(deployment.id)
                print(f"paused deployment {full_name} (serving stopped)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
