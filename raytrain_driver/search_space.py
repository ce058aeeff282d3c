"""A sweep's search space, as the `sweep` flow's `search` gives it, and the trial configs it makes.

    {"learning_rate": {"loguniform": [1e-4, 1e-1]}, "hidden": [32, 64], "batch_size": {"grid": [32, 64]}}

Each key is one of the pipeline's settings (``TrainingConfig``) or a key of the code's ``train_config``. Each value
is a list (one of these values, drawn), or one of ``{"choice": [...]}``, ``{"grid": [...]}`` (every value, in
turn), ``{"uniform": [low, high]}``, ``{"loguniform": [low, high]}``, ``{"randint": [low, high]}`` (high excluded).
Parsing is pure, and every value a trial could get is checked against the settings before anything starts.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from raytrain_tasks.errors import SettingsError, UserCodeError

KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
# The pipeline's settings a search may vary: what a trial trains with. The others are the sweep's: where it
# stores, tracks and runs (a deployment pins those: a search must not point them elsewhere), how many epochs and
# workers (ASHA and the trials' share of the cluster follow from them), the gate's rules.
SEARCHABLE = frozenset({"batch_size", "learning_rate", "seed"})


@dataclass(frozen=True)
class Dimension:
    """One searched name: a pipeline setting, or a key of ``train_config`` (``in_code``)."""

    name: str
    kind: str
    values: tuple[Any, ...]  # the choices, or the (low, high) bounds
    in_code: bool

    @property
    def extremes(self) -> tuple[Any, ...]:
        """The values to check before anything starts: every choice, or both bounds (randint's high is excluded)."""
        if self.kind == "randint":
            return (self.values[0], self.values[1] - 1)
        return self.values


def parse_search(
    search: Mapping[str, Any] | str, settings: frozenset[str], secret_keys: frozenset[str] = frozenset()
) -> tuple[Dimension, ...]:
    """The dimensions of ``search`` (its JSON text, or the object); SettingsError naming `search` and the key. A
    key is one of ``SEARCHABLE``, or a key of the code's train_config that is not one of its ``secret_keys``."""
    if isinstance(search, str):
        try:
            search = json.loads(search)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"search is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(search, Mapping) or not search:
        raise SettingsError('search must be a JSON object of settings to vary, e.g. {"learning_rate": [0.01, 0.1]}')
    for name in search:
        if name in settings and name not in SEARCHABLE:
            raise SettingsError(
                f"search[{name!r}]: {name} is the same for every trial of a sweep; set it on the sweep. A search "
                f"varies {', '.join(sorted(SEARCHABLE))} and the keys of your code's train_config"
            )
        if name in secret_keys:
            raise SettingsError(f"search[{name!r}]: a secret of your code's settings is not searched")
    return tuple(_dimension(str(name), value, name in settings) for name, value in search.items())


# How close an unknown key must be to a known name to be named as what was meant (a code's settings class).
MISSPELLING_CUTOFF = 0.8


def unknown_key_refusal(name: str, code_keys: tuple[str, ...], code_declares_all: bool) -> str:
    """Why ``name``, searched as a key of the code's train_config, is refused; "" if it is not. A code whose
    settings class declares its keys (``code_declares_all``) takes those alone. A code of plain defaults also
    takes keys it has no default for, but not one a typing slip away from a known name (``learning_rat``), which
    would vary nothing; ``eval_batch_size`` is a key of its own."""
    known = sorted(SEARCHABLE) + [key for key in code_keys if key not in SEARCHABLE]
    if name in known:
        return ""
    if code_declares_all:
        near = difflib.get_close_matches(name, known, n=1, cutoff=MISSPELLING_CUTOFF)
    else:
        slips = sorted((_edits(name, key), key) for key in known)
        near = [key for edits, key in slips[:1] if edits <= (2 if len(key) >= 6 else 1)]
        if not near:
            return ""
    hint = f"; did you mean {near[0]!r}?" if near else ""
    if not code_declares_all:
        hint += f" If your code reads {name!r}, give it a default in its TrainFunc or TrainSpec"
    code = f"the keys of your code's train_config ({', '.join(code_keys)})" if code_keys else "your code's keys"
    return (
        f"search[{name!r}]: no setting of that name. A search varies {', '.join(sorted(SEARCHABLE))} and {code}" + hint
    )


def _edits(a: str, b: str) -> int:
    """Levenshtein distance: the insertions, deletions and substitutions that make ``a`` into ``b``."""
    row = list(range(len(b) + 1))
    for i, char in enumerate(a, start=1):
        previous, row[0] = row[0], i
        for j, other in enumerate(b, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (char != other))
    return row[-1]


def _dimension(name: str, value: Any, is_setting: bool) -> Dimension:
    where = f"search[{name!r}]"
    if isinstance(value, list):
        kind, values = "choice", value
    elif isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in KINDS:
        kind, values = next(iter(value.items()))
    else:
        raise SettingsError(f"{where}: give a list of values, or one of {', '.join(KINDS)}: {{kind: [...]}}")
    if not isinstance(values, list) or not values:
        raise SettingsError(f"{where}: {kind} takes a non-empty list")
    if kind in ("uniform", "loguniform", "randint"):
        _check_range(where, kind, values)
    return Dimension(name, kind, tuple(values), in_code=not is_setting)


def _check_range(where: str, kind: str, values: list[Any]) -> None:
    numbers = len(values) == 2 and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if not numbers or not all(math.isfinite(v) for v in values) or values[0] >= values[1]:
        raise SettingsError(f"{where}: {kind} takes [low, high], two finite numbers, low below high")
    if kind == "loguniform" and values[0] <= 0:
        raise SettingsError(f"{where}: loguniform takes bounds above 0")
    if kind == "randint" and not all(isinstance(v, int) for v in values):
        raise SettingsError(f"{where}: randint takes two integers")


def trial_overrides(dimensions: tuple[Dimension, ...], drawn: Mapping[str, Any]) -> tuple[dict[str, Any], dict]:
    """(the settings, the ``train_config`` keys) a trial sets: ``drawn`` holds one value per dimension."""
    settings = {d.name: drawn[d.name] for d in dimensions if not d.in_code}
    code = {d.name: drawn[d.name] for d in dimensions if d.in_code}
    return settings, code


def check_every_value(dimensions: tuple[Dimension, ...], check: Callable[[dict[str, Any], dict], None]) -> None:
    """``check(settings, train_config)`` for each value of each dimension alone (the others as the sweep sets
    them): a value no trial could train with is refused before any trial starts, naming it."""
    for dimension in dimensions:
        for value in dimension.extremes:
            settings, code = trial_overrides((dimension,), {dimension.name: value})
            try:
                check(settings, code)
            except (SettingsError, UserCodeError, ValueError, TypeError) as exc:  # ValidationError: a ValueError
                raise SettingsError(f"search[{dimension.name!r}]: the value {value!r} is refused: {exc}") from None


def tune_space(dimensions: tuple[Dimension, ...]) -> dict[str, Any]:
    """Ray Tune's ``param_space`` of the dimensions."""
    from ray import tune

    make: dict[str, Callable[..., Any]] = {
        "choice": lambda values: tune.choice(list(values)),
        "grid": lambda values: tune.grid_search(list(values)),
        "uniform": lambda values: tune.uniform(*values),
        "loguniform": lambda values: tune.loguniform(*values),
        "randint": lambda values: tune.randint(*values),
    }
    return {d.name: make[d.kind](d.values) for d in dimensions}
