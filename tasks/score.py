"""The scoring flow's tasks (flows/scoring.py): resolve-model plans the run and refuses what would fail, score-table
predicts and commits (raytrain_driver.scoring, raytrain_driver.scoring_run). Neither is retried: a refusal needs
another setting, and a failed run is run again as a whole (its output is written whole or not at all)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from raytrain_driver.scoring import ScoringPlan, plan_scoring
from raytrain_driver.scoring_run import ScoringResult, score
from raytrain_tasks.redact import redacted_errors
from raytrain_tasks.scoring.config import ScoringConfig


@task(name="resolve-model", cache_policy=NONE)
def resolve_model(config: ScoringConfig, scratch: str) -> ScoringPlan:
    """The version ``config.model`` names now, checked, and the input and output checked against it."""
    with redacted_errors():
        return plan_scoring(config, Path(scratch))


@task(name="score-table", cache_policy=NONE)
def score_table(config: ScoringConfig, plan: ScoringPlan) -> ScoringResult:
    """Every input row's prediction, committed as one Parquet file and recorded in MLflow."""
    with redacted_errors():
        return score(config, plan)
