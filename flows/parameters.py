"""The flow's parameters: one per ``TrainingConfig`` field, so every Prefect way of changing a setting works.

Prefect merges a deployment run's parameters into its deployment's by top-level key only. With one parameter per
setting, that merge is the one users expect: ``prefect deployment run training-pipeline/nightly-retrain -p
epochs=3`` (or ``--params '{"epochs": 3}'``, ``run_deployment(parameters=...)``, an automation's run-deployment
action, the UI's custom run) trains with ``epochs=3`` and every other setting of the deployment. Prefect builds the
UI form and the server-side validation from the flow's signature; the signature is made here from the config
model, so both carry each field's type, title, description, bounds and choices, and nothing is written twice.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field

from raytrain_tasks.config import PINNED, PINNED_NOTE, SETTINGS, TrainingConfig

F = TypeVar("F", bound=Callable[..., Any])


def _setting(name: str, model: type[BaseModel] = TrainingConfig) -> inspect.Parameter:
    field = model.model_fields[name]
    # Bounds, lengths and choices sit in the annotation, where Prefect's form builder keeps them. Prefect titles a
    # parameter by its name and takes descriptions from a FieldInfo default (which its validation then hands to
    # the flow as the value of an unset parameter, in 3.8.8), so title and description go in as schema extras.
    description = f"{field.description or ''} {PINNED_NOTE if name in PINNED else ''}".strip()
    shown = Field(json_schema_extra={"title": field.title or name, "description": description})
    annotation = Annotated[(field.annotation, *field.metadata, shown)]  # type: ignore[name-defined]  # made at run time
    default = inspect.Parameter.empty if field.is_required() else field.default
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def with_settings_as_parameters(fn: F) -> F:
    """``fn(<its own keyword parameters>, **settings)`` shown to Prefect as one keyword parameter per setting."""
    # Evaluated, bounds included: the module's annotations are text (``from __future__ import annotations``).
    hints = typing.get_type_hints(fn, include_extras=True)
    own = [
        parameter.replace(
            kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(parameter.name, parameter.annotation)
        )
        for parameter in inspect.signature(fn).parameters.values()
        if parameter.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    clash = {parameter.name for parameter in own} & set(SETTINGS)  # one name, two meanings: refuse at import
    if clash:
        raise TypeError(f"{fn.__name__}'s own parameters {sorted(clash)} are also training settings")
    settings = [_setting(name) for name in SETTINGS]
    fn.__signature__ = inspect.signature(fn).replace(parameters=[*settings, *own])  # type: ignore[attr-defined]
    return fn


def with_fields_as_parameters(model: type[BaseModel]) -> Callable[[F], F]:
    """``fn(**settings)`` shown to Prefect as one keyword parameter per field of ``model`` (the scoring flow's
    ``ScoringConfig``): its form and the server's check of a run's parameters carry each field's bounds."""

    def decorate(fn: F) -> F:
        fn.__signature__ = inspect.signature(fn).replace(  # type: ignore[attr-defined]
            parameters=[_setting(name, model) for name in model.model_fields]
        )
        return fn

    return decorate
