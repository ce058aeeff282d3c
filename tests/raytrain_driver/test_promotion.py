"""The champion decision, table-driven: no cluster, no registry."""

from __future__ import annotations

import pytest

from raytrain_driver.promotion import Champion, Promotion, decide_promotion


@pytest.mark.parametrize(
    ("candidate", "champion", "min_improvement", "promote", "expected"),
    [
        (0.90, None, 0.0, True, Promotion.PROMOTE),  # first model becomes champion
        (0.95, 0.90, 0.0, True, Promotion.PROMOTE),  # strictly better
        (0.90, 0.90, 0.0, True, Promotion.KEEP_CHAMPION),  # a tie does not churn the alias
        (0.85, 0.90, 0.0, True, Promotion.KEEP_CHAMPION),  # worse
        (0.91, 0.90, 0.02, True, Promotion.KEEP_CHAMPION),  # better, but below the margin
        (0.92, 0.90, 0.02, True, Promotion.PROMOTE),  # exactly the margin
        # Exactly the margin with decimal inputs whose binary difference falls just short of it:
        (0.95, 0.93, 0.02, True, Promotion.PROMOTE),  # 0.95 - 0.93 == 0.0199999999999999
        (0.3, 0.1, 0.2, True, Promotion.PROMOTE),  # 0.3 - 0.1 == 0.19999999999999998
        (0.7, 0.6, 0.1, True, Promotion.PROMOTE),  # 0.09999999999999998
        (0.9499, 0.93, 0.02, True, Promotion.KEEP_CHAMPION),  # truly below the margin
        (0.99, 0.50, 0.0, False, Promotion.NOT_REQUESTED),  # switched off
        (0.99, None, 0.0, False, Promotion.NOT_REQUESTED),
    ],
)
def test_decision(
    candidate: float, champion: float | None, min_improvement: float, promote: bool, expected: Promotion
) -> None:
    current = Champion.absent() if champion is None else Champion(version="1", score=champion)
    decision = decide_promotion(candidate, current, min_improvement=min_improvement, promote=promote)
    assert decision.action is expected
    assert decision.candidate_score == candidate and decision.champion_score == champion
    assert decision.reason


@pytest.mark.parametrize(
    ("candidate", "champion", "min_improvement", "expected"),
    [
        (0.2, 0.3, 0.0, Promotion.PROMOTE),
        (0.3, 0.2, 0.0, Promotion.KEEP_CHAMPION),
        (0.1, 0.3, 0.2, Promotion.PROMOTE),  # 0.3 - 0.1 with floating-point error
        (0.25, 0.3, 0.1, Promotion.KEEP_CHAMPION),
        # An RMSE in its own units: a margin above 1.0 is a setting, not an error.
        (120.0, 150.0, 25.0, Promotion.PROMOTE),
        (130.0, 150.0, 25.0, Promotion.KEEP_CHAMPION),
    ],
)
def test_lower_is_better_metrics(
    candidate: float, champion: float, min_improvement: float, expected: Promotion
) -> None:
    decision = decide_promotion(
        candidate, Champion("4", score=champion), min_improvement=min_improvement, higher_is_better=False
    )
    assert decision.action is expected


def test_a_champion_that_could_not_be_assessed_keeps_its_alias() -> None:
    error = Champion("3", error="loading it failed: OSError: connection refused")
    decision = decide_promotion(0.99, error)
    assert decision.action is Promotion.UNDECIDED
    assert not decision.action.moves_champion and not decision.action.is_final
    assert "connection refused" in decision.reason and "version 3" in decision.reason


def test_an_incomparable_champion_is_kept_unless_replacing_it_is_asked_for() -> None:
    other = Champion("2", incomparable="its input schema differs")
    kept = decide_promotion(0.5, other)
    assert kept.action is Promotion.KEEP_INCOMPARABLE and not kept.action.moves_champion
    assert "replace_incomparable_champion" in kept.reason
    replaced = decide_promotion(0.5, other, replace_incomparable=True)
    assert replaced.action is Promotion.REPLACE_INCOMPARABLE and replaced.action.moves_champion


@pytest.mark.parametrize("higher_is_better", [True, False])
@pytest.mark.parametrize("champion", [Champion.absent(), Champion("3", score=0.5)], ids=["no champion", "champion"])
def test_a_score_that_is_not_a_number_takes_no_alias(champion: Champion, higher_is_better: bool) -> None:
    """A NaN score (a split that scored no row, a diverged model) compares false both ways: it must not take
    `champion` for want of one to beat, nor by any direction's arithmetic."""
    decision = decide_promotion(float("nan"), champion, higher_is_better=higher_is_better)
    assert decision.action is Promotion.UNDECIDED and "not a number" in decision.reason


def test_a_champion_whose_score_is_not_a_number_is_replaced_by_a_scored_model() -> None:
    """A champion promoted with a NaN score (before NaN was refused) would win every comparison by default."""
    decision = decide_promotion(0.2, Champion("3", score=float("nan")), higher_is_better=False)
    assert decision.action is Promotion.PROMOTE and "not a number" in decision.reason
