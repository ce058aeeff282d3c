"""register-model: the Prefect task that registers a fit's model behind the promotion gate
(raytrain_driver/register.py).

It hands the driver this task run's logger and tags the version with the flow run (and deployment) it came from.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.runtime import deployment, flow_run

from raytrain_driver.fit_record import FitResult
from raytrain_driver.hooks import RunHooks, run_hooks
from raytrain_driver.register import ModelRef, register
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.prepared import RunData

__all__ = ["ModelRef", "register_model"]


@task(name="register-model", task_run_name="register-{fit.run_key}", cache_policy=NONE)
def register_model(config: TrainingConfig, dataset: RunData | None, fit: FitResult) -> ModelRef:
    """Log the best checkpoint as an MLflow model in the fit's run and register (at most) one version of it."""
    with run_hooks(RunHooks(get_run_logger())):
        tags = {"prefect.flow_run_id": str(flow_run.get_id())} if flow_run.get_id() else {}
        if deployment.get_name():  # the champion history says which deployment's run moved the alias
            tags["prefect.deployment_name"] = str(deployment.get_name())
        return register(config, dataset, fit, tags)
