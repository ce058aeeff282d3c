"""Whether a newly trained model version takes the ``champion`` alias: a pure decision."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Promotion(Enum):
    PROMOTE = "promote"
    KEEP_CHAMPION = "keep_champion"
    NOT_REQUESTED = "not_requested"


@dataclass(frozen=True)
class PromotionDecision:
    action: Promotion
    reason: str
    candidate_score: float
    champion_score: float | None


def decide_promotion(
    candidate_score: float,
    champion_score: float | None,
    *,
    min_improvement: float = 0.0,
    promote: bool = True,
    higher_is_better: bool = True,
) -> PromotionDecision:
    """Promote when allowed and there is no comparable champion, or the candidate is strictly better by at
    least ``min_improvement``; a tie keeps the champion, so equal retrains do not churn the alias."""
    if not promote:
        return PromotionDecision(Promotion.NOT_REQUESTED, "promotion switched off", candidate_score, champion_score)
    if champion_score is None:
        return PromotionDecision(Promotion.PROMOTE, "no comparable champion", candidate_score, champion_score)
    gain = candidate_score - champion_score if higher_is_better else champion_score - candidate_score
    if gain > 0 and gain >= min_improvement:
        return PromotionDecision(
            Promotion.PROMOTE,
            f"beats champion by {gain:.4f} (required {min_improvement:.4f})",
            candidate_score,
            champion_score,
        )
    if gain <= 0:
        reason = f"does not beat the champion ({candidate_score:.4f} vs {champion_score:.4f})"
    else:
        reason = f"gain {gain:.4f} is below min_improvement {min_improvement:.4f}"
    return PromotionDecision(Promotion.KEEP_CHAMPION, reason, candidate_score, champion_score)
