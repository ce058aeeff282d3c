"""Your code's own settings (``TrainFunc``/``TrainSpec`` ``defaults=`` or ``settings=``) against ``train_config``.

Both are checked where the run starts, before Prefect, Ray or any worker: a ``settings`` class refuses a key it
does not declare, a value of the wrong type and a required setting left out; plain ``defaults`` refuse a key that
is a misspelling of one of theirs (``hiden`` beside ``hidden``), which would otherwise train silently with the
default. What the code then receives is plain JSON values, the same that MLflow logs as ``train_config.<key>``.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
from collections.abc import Mapping
from typing import Any

from raytrain_tasks.errors import UserCodeError

# How close a train_config key must be to one of the code's defaults to be taken for its misspelling.
MISSPELLING_CUTOFF = 0.8


def setting_names(settings: type, where: str) -> list[str]:
    """The settings a class declares, in order; TypeError when it is not a class pydantic can validate."""
    properties = _schema(settings, where).get("properties", {})
    return list(properties)


def code_values(spec: Any, train_config: Mapping[str, Any], train_code: str) -> dict[str, Any]:
    """What the user's code gets in ``config`` beside the pipeline's keys: its defaults (or its settings class's)
    with ``train_config`` over them, checked. UserCodeError naming ``train_config.<key>`` otherwise."""
    if spec.settings is None:
        _check_spelling(dict(spec.defaults), train_config, train_code)
        _check_quoted_numbers(dict(spec.defaults), train_config, train_code)
        return {**dict(spec.defaults), **train_config}
    from pydantic import ValidationError

    settings = spec.settings
    names = setting_names(settings, settings.__name__)
    if unknown := [key for key in train_config if key not in names]:
        near = {key: difflib.get_close_matches(key, names, n=1) for key in unknown}
        hints = "".join(f" (did you mean {near[key][0]!r} for {key!r}?)" for key in unknown if near[key])
        raise UserCodeError(
            f"train_code {train_code!r}: train_config sets {', '.join(map(repr, unknown))}, which its settings "
            f"class {settings.__name__} does not declare{hints}. Its settings: {describe(settings)}"
        )
    adapter = _adapter(settings)
    try:
        # Strict, on JSON types (what a flag, a form or a deployment gives): "64" is not an int, true not an int.
        value = adapter.validate_json(json.dumps(dict(train_config)), strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"train_config.{'.'.join(map(str, error['loc'])) or '?'}: {error['msg']}"
            + ("" if error["type"] == "missing" else f" (got {type(error['input']).__name__})")
            for error in exc.errors()
        )
        raise UserCodeError(
            f"train_code {train_code!r}: train_config does not fit its settings class {settings.__name__}: "
            f"{problems}. Its settings: {describe(settings)}"
        ) from None  # pydantic's own text repeats the values, which may be secrets
    dumped: dict[str, Any] = adapter.dump_python(value, mode="json")  # pydantic masks secrets here
    if secrets := secret_keys(settings):  # the code gets them as they were given
        plain = adapter.dump_python(value, mode="python")
        dumped.update({key: _revealed(plain[key]) for key in secrets if key in plain})
    return dumped


def shown_values(spec: Any, train_config: Mapping[str, Any], train_code: str) -> dict[str, Any]:
    """``code_values`` as the run shows them (its params, logs, the version): its secrets masked."""
    secrets = secret_keys(spec.settings)
    return {
        key: SECRET_MASK if key in secrets else value
        for key, value in code_values(spec, train_config, train_code).items()
    }


# pydantic's own mask for a SecretStr: what the run shows in place of a secret setting.
SECRET_MASK = "**********"


def secret_keys(settings: type | None) -> frozenset[str]:
    """The settings whose values are secrets (typed SecretStr, SecretBytes or pydantic's Secret): masked wherever
    the run shows its settings. A setting that holds one anywhere inside (a nested model) is masked whole."""
    if settings is None:
        return frozenset()
    schema = _schema(settings, settings.__name__)
    definitions = schema.get("$defs", {})
    marked = {name for name, field in schema.get("properties", {}).items() if _holds_secret(field, definitions)}
    # Secret[int] and the like leave no mark in the schema: their types tell.
    return frozenset(marked | {name for name, hint in _field_types(settings).items() if _secret_type(hint)})


def _holds_secret(node: Any, definitions: dict[str, Any], seen: frozenset[str] = frozenset()) -> bool:
    """Whether a JSON schema node describes a secret anywhere: pydantic marks them writeOnly, format password."""
    if isinstance(node, list):
        return any(_holds_secret(item, definitions, seen) for item in node)
    if not isinstance(node, dict):
        return False
    if node.get("writeOnly") is True or node.get("format") == "password":
        return True
    reference = node.get("$ref")
    if isinstance(reference, str) and reference not in seen:
        target = definitions.get(reference.rsplit("/", 1)[-1])
        if _holds_secret(target, definitions, seen | {reference}):
            return True
    return any(_holds_secret(item, definitions, seen) for key, item in node.items() if key not in ("$ref", "default"))


def _field_types(settings: type) -> dict[str, Any]:
    """A settings class's fields and their types (a pydantic model's or a dataclass's); {} where unknown."""
    import dataclasses
    import typing

    from pydantic import BaseModel

    if isinstance(settings, type) and issubclass(settings, BaseModel):
        return {name: field.annotation for name, field in settings.model_fields.items()}
    if dataclasses.is_dataclass(settings):
        try:
            hints = typing.get_type_hints(settings, include_extras=True)
        except (NameError, TypeError):  # an annotation that does not resolve: the schema's marks alone
            return {}
        return {field.name: hints.get(field.name) for field in dataclasses.fields(settings)}
    return {}


def _secret_type(hint: Any, seen: frozenset[type] = frozenset()) -> bool:
    """Whether a type is, or holds anywhere inside, one of pydantic's secret types."""
    import typing

    from pydantic.types import _SecretBase

    origin = typing.get_origin(hint) or hint
    if isinstance(origin, type) and issubclass(origin, _SecretBase):
        return True
    if isinstance(hint, type) and hint not in seen and _field_types(hint):
        return any(_secret_type(inner, seen | {hint}) for inner in _field_types(hint).values())
    return any(_secret_type(arg, seen) for arg in typing.get_args(hint) if not isinstance(arg, str | int | float))


def _revealed(value: Any) -> Any:
    """A setting's value as JSON, its secrets in clear."""
    from pydantic import TypeAdapter
    from pydantic.types import _SecretBase

    def reveal(item: Any) -> Any:
        if isinstance(item, _SecretBase):
            secret = item.get_secret_value()
            return secret.decode() if isinstance(secret, bytes) else secret
        if isinstance(item, dict):
            return {key: reveal(inner) for key, inner in item.items()}
        if isinstance(item, list | tuple | set | frozenset):
            return [reveal(inner) for inner in item]
        return item

    return TypeAdapter(Any).dump_python(reveal(value), mode="json")


def describe(settings: type) -> str:
    """``hidden (integer, default 32), name (string, required)``: what a message lists."""
    schema = _schema(settings, settings.__name__)
    required = set(schema.get("required", ()))
    parts = []
    for name, field in schema.get("properties", {}).items():
        kind = field.get("type") or "/".join(str(o.get("type", "?")) for o in field.get("anyOf", ())) or "any"
        if "enum" in field:
            kind = " or ".join(map(repr, field["enum"]))
        parts.append(f"{name} ({kind}, {'required' if name in required else 'default ' + repr(field.get('default'))})")
    return ", ".join(parts) or "none"


def form_schema(settings: type) -> dict[str, Any]:
    """The JSON schema of ``train_config`` for a Prefect deployment's run form: one typed field per setting, each
    with its default; definitions it refers to inlined under ``definitions`` (Prefect's parameter schema key)."""
    schema = _schema(settings, settings.__name__, ref_template="#/definitions/{model}")
    if "$defs" in schema:
        schema["definitions"] = schema.pop("$defs")
    schema["additionalProperties"] = False  # the server refuses a misspelt key, as the CLI does
    if not schema.get("required"):
        schema["default"] = {}
    schema["title"] = "Training code config"
    schema.setdefault("description", f"The settings of {settings.__name__}, your code's own")
    return schema


def _schema(settings: type, where: str, ref_template: str = "#/$defs/{model}") -> dict[str, Any]:
    """The class's JSON schema (a copy: callers may change it); TypeError naming ``where`` when pydantic cannot
    validate the class."""
    import dataclasses

    from pydantic import BaseModel, PydanticUserError

    if not (dataclasses.is_dataclass(settings) or issubclass(settings, BaseModel)):
        raise TypeError(f"{where} must be a pydantic BaseModel subclass or a dataclass, got {settings!r}")
    try:
        schema = _json_schema(settings, ref_template)
    except PydanticUserError as exc:  # a field of a type pydantic cannot validate (an arbitrary class)
        raise TypeError(f"{where}: pydantic cannot describe its fields ({type(exc).__name__}: {exc})") from None
    return copy.deepcopy(schema)


@functools.cache
def _adapter(settings: type) -> Any:
    """One pydantic TypeAdapter per class: ``config`` is built from it several times a run, on every worker."""
    from pydantic import TypeAdapter

    return TypeAdapter(settings)


@functools.cache
def _json_schema(settings: type, ref_template: str) -> dict[str, Any]:
    schema: dict[str, Any] = _adapter(settings).json_schema(ref_template=ref_template)
    return schema


def _check_spelling(defaults: dict[str, Any], train_config: Mapping[str, Any], train_code: str) -> None:
    """A key of ``train_config`` that is not one of ``defaults`` but close to one ``train_config`` leaves to its
    default is taken for a misspelling: refused, since the code would train on the default without a word."""
    left = [name for name in defaults if name not in train_config]
    for key in train_config:
        if key in defaults:
            continue
        if near := difflib.get_close_matches(key, left, n=1, cutoff=MISSPELLING_CUTOFF):
            raise UserCodeError(
                f"train_code {train_code!r}: train_config sets {key!r}, which its defaults do not have; did you "
                f"mean {near[0]!r}? (its defaults: {', '.join(map(repr, defaults))}). If the code reads {key!r} "
                "itself, give it a default too (or declare its settings with settings=...)"
            )


def _check_quoted_numbers(defaults: dict[str, Any], train_config: Mapping[str, Any], train_code: str) -> None:
    """A quoted number where the code's default is a number (``{"hidden": "64"}`` beside ``hidden: 32``) is
    refused: the code would get the text, and fail on a worker minutes later (or repeat a string 64 times). Other
    types are left to the code, whose defaults do not say which it accepts (``settings=`` checks them all). The
    value is not repeated: it may be a secret pasted into the wrong key."""
    for key, value in train_config.items():
        default = defaults.get(key)
        if not isinstance(value, str) or isinstance(default, bool) or not isinstance(default, int | float):
            continue
        try:
            float(value)
        except ValueError:
            continue
        kind = "an integer" if isinstance(default, int) else "a number"
        raise UserCodeError(
            f"train_code {train_code!r}: train_config.{key} is a quoted number (a string), while its default "
            f"{default!r} is {kind}: write it as a JSON number, without quotes, or declare "
            "the code's settings with settings=... to have every value's type checked"
        )
