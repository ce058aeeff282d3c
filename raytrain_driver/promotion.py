"""Whether a newly trained model version takes the ``champion`` alias: a pure decision.

Fail closed: when the champion could not be looked up or scored, nothing moves (``UNDECIDED``). Only a
registered model without a ``champion`` alias counts as having no champion.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from enum import Enum

# The registered model's aliases: the version in service, a registered version that did not win, the one before.
CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous_champion"

# Scores are rounded to this many decimals before the margin test: 0.95 - 0.93 is 0.0199999... in binary
# floating point, and must still count as a gain of 0.02.
SCORE_DECIMALS = 9


class Promotion(Enum):
    PROMOTE = "promote"
    KEEP_CHAMPION = "keep_champion"
    NOT_REQUESTED = "not_requested"
    KEEP_INCOMPARABLE = "keep_incomparable_champion"
    REPLACE_INCOMPARABLE = "replace_incomparable_champion"
    UNDECIDED = "undecided"

    @property
    def is_final(self) -> bool:
        """A final decision is never redone; an undecided one is, by a retry or a resume of the run."""
        return self is not Promotion.UNDECIDED

    @property
    def moves_champion(self) -> bool:
        return self in (Promotion.PROMOTE, Promotion.REPLACE_INCOMPARABLE)


@dataclass(frozen=True)
class Champion:
    """What is known of the current champion, scored on the candidate's test split."""

    version: str | None
    score: float | None = None
    incomparable: str = ""  # why its scores cannot be compared with the candidate's (another input schema)
    error: str = ""  # why it could not be looked up or scored (an outage, an unloadable model)

    @classmethod
    def absent(cls) -> Champion:
        return cls(version=None)


@dataclass(frozen=True)
class PromotionDecision:
    action: Promotion
    reason: str
    candidate_score: float
    champion_score: float | None
    champion_version: str | None = None  # the champion it was decided against, which a move must still find


NOT_COMPARABLE = "not a number the gate can compare"


def decide_again(reason: str, run_key: str) -> str:
    """What to do about a decision that could not be made for ``reason``: run again, unless the candidate's own
    score made it (a resume reads the same score)."""
    if NOT_COMPARABLE in reason:
        return "its score will not change: fix what made it not a number, and train a new run"
    return f"run again with `resume={run_key}` to decide again"


def _not_a_number(candidate_score: float, champion: Champion) -> PromotionDecision | None:
    """NaN compares false either way: a candidate scored NaN must not win for want of a champion, and a champion
    scored NaN (promoted before this check existed) must not win every comparison by default."""
    if not math.isfinite(candidate_score):
        reason = f"this run's score is {candidate_score}, {NOT_COMPARABLE}: no alias moves"
        return PromotionDecision(Promotion.UNDECIDED, reason, candidate_score, champion.score)
    if champion.version and not champion.incomparable and champion.score is not None:
        if not math.isfinite(champion.score):
            reason = f"the champion's score is {champion.score}, not a number: any scored model beats it"
            return PromotionDecision(Promotion.PROMOTE, reason, candidate_score, champion.score)
    return None


def decide_promotion(
    candidate_score: float,
    champion: Champion,
    *,
    min_improvement: float = 0.0,
    promote: bool = True,
    higher_is_better: bool = True,
    replace_incomparable: bool = False,
) -> PromotionDecision:
    """Promote when allowed and there is no champion, or the candidate is strictly better by at least
    ``min_improvement``; a tie keeps the champion, so equal retrains do not churn the alias. A champion that
    could not be assessed keeps its alias and leaves the decision open."""
    decision = functools.partial(PromotionDecision, champion_version=champion.version)
    score = champion.score
    if not promote:
        return decision(Promotion.NOT_REQUESTED, "promotion switched off", candidate_score, score)
    if champion.error:
        return decision(
            Promotion.UNDECIDED,
            f"champion version {champion.version or '?'} could not be assessed, so it keeps its alias: "
            f"{champion.error}",
            candidate_score,
            score,
        )
    if (unscored := _not_a_number(candidate_score, champion)) is not None:
        return dataclasses.replace(unscored, champion_version=champion.version)
    if champion.version is None:
        return decision(Promotion.PROMOTE, "no champion yet", candidate_score, None)
    if champion.incomparable:
        if replace_incomparable:
            reason = (
                f"replaces an incomparable champion on request (replace_incomparable_champion): {champion.incomparable}"
            )
            return decision(Promotion.REPLACE_INCOMPARABLE, reason, candidate_score, score)
        reason = (
            f"champion version {champion.version} is not comparable and keeps its alias: {champion.incomparable}; "
            "a new run with `replace_incomparable_champion` on (--replace-incomparable-champion) replaces it on "
            "purpose, unscored"
        )
        return decision(Promotion.KEEP_INCOMPARABLE, reason, candidate_score, score)
    if score is None:
        raise ValueError("a comparable champion needs a score")
    raw_gain = candidate_score - score if higher_is_better else score - candidate_score
    gain = round(raw_gain, SCORE_DECIMALS)
    required = round(min_improvement, SCORE_DECIMALS)
    if gain > 0 and gain >= required:
        reason = f"beats champion version {champion.version} by {gain:.4f} (required {required:.4f})"
        return decision(Promotion.PROMOTE, reason, candidate_score, score)
    if gain <= 0:
        reason = f"does not beat champion version {champion.version} ({candidate_score:.4f} vs {score:.4f})"
    else:
        reason = f"gain {gain:.4f} over champion version {champion.version} is below min_improvement {required:.4f}"
    return decision(Promotion.KEEP_CHAMPION, reason, candidate_score, score)
