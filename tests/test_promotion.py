"""The champion decision, table-driven: no cluster, no registry."""

from __future__ import annotations

import pytest

from tasks.promotion import Promotion, decide_promotion


@pytest.mark.parametrize(
    ("candidate", "champion", "min_improvement", "promote", "expected"),
    [
        (0.90, None, 0.0, True, Promotion.PROMOTE),  # first model becomes champion
        (0.95, 0.90, 0.0, True, Promotion.PROMOTE),  # strictly better
        (0.90, 0.90, 0.0, True, Promotion.KEEP_CHAMPION),  # a tie does not churn the alias
        (0.85, 0.90, 0.0, True, Promotion.KEEP_CHAMPION),  # worse
        (0.91, 0.90, 0.02, True, Promotion.KEEP_CHAMPION),  # better, but below the margin
        (0.92, 0.90, 0.02, True, Promotion.PROMOTE),  # exactly the margin
        (0.99, 0.50, 0.0, False, Promotion.NOT_REQUESTED),  # switched off
        (0.99, None, 0.0, False, Promotion.NOT_REQUESTED),
    ],
)
def test_decision(
    candidate: float, champion: float | None, min_improvement: float, promote: bool, expected: Promotion
) -> None:
    decision = decide_promotion(candidate, champion, min_improvement=min_improvement + 0.0, promote=promote)
    assert decision.action is expected
    assert decision.candidate_score == candidate and decision.champion_score == champion
    assert decision.reason


def test_lower_is_better_metrics() -> None:
    assert decide_promotion(0.2, 0.3, higher_is_better=False).action is Promotion.PROMOTE
    assert decide_promotion(0.3, 0.2, higher_is_better=False).action is Promotion.KEEP_CHAMPION
