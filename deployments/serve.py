"""Serve the deployments of deployments/prefect.yaml from this one process, schedules included.

    python -m deployments.serve      # needs PREFECT_API_URL pointing at a Prefect server

For users without a work pool. While it runs, scheduled runs and runs triggered from the UI execute here.
When it stops, Prefect pauses its deployments' schedules (no runs pile up); serving again resumes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flows.training import training_pipeline

PREFECT_YAML = Path(__file__).with_name("prefect.yaml")


def load_deployment_specs(path: Path = PREFECT_YAML) -> list[dict[str, Any]]:
    """The `deployments:` entries of prefect.yaml, with YAML anchors resolved."""
    return list(yaml.safe_load(path.read_text())["deployments"])


def build_deployments(specs: list[dict[str, Any]]) -> list[Any]:
    from prefect.schedules import Cron

    deployments = []
    for spec in specs:
        schedules = [Cron(s["cron"], timezone=s.get("timezone")) for s in spec.get("schedules") or []]
        deployments.append(
            training_pipeline.to_deployment(
                name=spec["name"],
                description=spec.get("description"),
                tags=spec.get("tags"),
                parameters=spec.get("parameters"),
                schedules=schedules or None,
            )
        )
    return deployments


def main() -> None:
    from prefect import serve

    serve(*build_deployments(load_deployment_specs()))


if __name__ == "__main__":
    main()
