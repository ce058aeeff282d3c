"""The MLflow run's name and the tags that lead back to the Prefect flow run that trains it."""

from __future__ import annotations

from raytrain_driver.origin import ENTRY_POINT


def prefect_origin(run_key: str) -> dict[str, str]:
    """The MLflow run's name and the tags that lead back to the Prefect flow run, taken here, in the Prefect run
    (a Ray Job that trains for it has no Prefect context)."""
    from prefect.runtime import deployment, flow_run
    from prefect.utilities.urls import url_for

    name = flow_run.get_name()
    origin = {"run_name": f"{name}-{run_key}" if name else run_key}
    # MLflow's own source tags: the UI's "Source" column and run page show the entry point, not "—".
    origin["mlflow.source.type"] = "JOB"
    origin["mlflow.source.name"] = ENTRY_POINT
    if flow_run.get_id():
        origin["prefect.flow_run_id"] = str(flow_run.get_id())
        ui_url = url_for("flow-run", obj_id=str(flow_run.get_id()))  # the UI's route, as Prefect's "View at" log
        if ui_url and ui_url.startswith(("http://", "https://")):  # the temporary server has no UI URL
            origin["prefect.flow_run_url"] = ui_url
    if deployment.get_name():
        origin["prefect.deployment_name"] = str(deployment.get_name())
    return origin
