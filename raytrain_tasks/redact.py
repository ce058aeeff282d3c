"""One place that knows what a secret looks like, so that none reaches a log, a param, an artifact or an error.

Three kinds are masked with ``***``: the password of a ``scheme://user:password@host`` URL (MLflow embeds the
full tracking URL in its error messages) or of a ``user:password@host`` given without a scheme, the value of a
credential-like query parameter (``?token=...``, a presigned URL's signature), and the value of every credential
environment variable of this process.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# Their values are masked wherever they appear, whatever the text around them.
SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    "DATABRICKS_TOKEN",
    "RAY_AUTH_TOKEN",
    "PREFECT_API_KEY",
)
# The password runs to the next '@' and may hold '/': masking a path that has '@' in it too is the safe mistake.
_URL_PASSWORD = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@'\"]+:)[^@\s'\"]+@")
# ``user:password@host`` typed without a scheme (a validation error would echo it); not after a word, '/', ':' or
# '@', and not a path after a scheme (MLflow's ``models:/NAME@ALIAS`` names a model, not a password).
_BARE_PASSWORD = re.compile(r"(?<![\w.+%:/@-])([A-Za-z0-9._%+-]+:)(?!/)[^@\s'\"]+@(?=[A-Za-z0-9\[])")
_SECRET_QUERY = re.compile(
    r"(?i)([?&](?:access_token|token|password|passwd|secret|api_key|apikey|key|signature|sig|"
    r"x-amz-signature|x-amz-credential|x-amz-security-token)=)[^&\s'\"#]+"
)
# Too short to mask without mangling ordinary text (and too short to be a real credential).
_MIN_SECRET_LENGTH = 6


def redact(text: str) -> str:
    """``text`` with every secret it contains replaced by ***."""
    text = _URL_PASSWORD.sub(rf"\1{MASK}@", text)
    text = _BARE_PASSWORD.sub(rf"\1{MASK}@", text)
    text = _SECRET_QUERY.sub(rf"\1{MASK}", text)
    for name in SECRET_ENV:
        value = os.environ.get(name, "")
        if len(value) >= _MIN_SECRET_LENGTH and value in text:
            text = text.replace(value, MASK)
    return text


def redact_uri(uri: str) -> str:
    """``uri`` without its password and without secret query values; the rest is kept to tell where it points."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return redact(uri)
    if parts.password:
        host = parts.hostname or ""
        netloc = f"{parts.username}:{MASK}@{host}" + (f":{parts.port}" if parts.port else "")
        uri = urlunsplit(parts._replace(netloc=netloc))
    return redact(uri)


def strip_credentials(uri: str) -> tuple[str, str, str]:
    """``(uri without user:password@, user, password)``; user and password are empty when the URI has none."""
    parts = urlsplit(uri)
    if not parts.username and not parts.password:
        return uri, "", ""
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc)), parts.username or "", parts.password or ""


def redact_exception(exc: BaseException) -> BaseException:
    """Mask secrets in ``exc``'s arguments (and message attributes), and in its causes, in place; returns ``exc``.

    The type stays the same, so handlers and retry conditions that look at it see no difference.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        try:
            current.args = tuple(redact(a) if isinstance(a, str) else a for a in current.args)
            for attribute in ("message", "msg", "detail"):
                value = current.__dict__.get(attribute)
                if isinstance(value, str):
                    setattr(current, attribute, redact(value))
        except (AttributeError, TypeError):
            pass  # an exception type with read-only attributes: its text is masked by the log filter below
        current = current.__cause__ or current.__context__
    return exc


@contextmanager
def redacted_errors() -> Iterator[None]:
    """An exception leaving the block has its secrets masked first (Prefect stores its text in the run's state
    message and logs its traceback); its type and traceback are kept."""
    try:
        yield
    except BaseException as exc:  # re-raised, only its text changed: nothing is swallowed
        raise redact_exception(exc)  # noqa: B904  # the same exception object, not a new one


class RedactingFilter(logging.Filter):
    """Masks secrets in a record's message, arguments and traceback before any handler formats it."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            message = str(record.msg)
        record.msg, record.args = redact(message), None
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


_FILTER = RedactingFilter()


def install_log_redaction(*logger_names: str) -> None:
    """Add the filter to every handler of the root logger and of ``logger_names`` (idempotent).

    On handlers, not loggers: a logger's filters do not see records its children propagate to it.
    """
    for name in ("", *logger_names):
        for handler in logging.getLogger(name).handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)


def strings_in(value: Any) -> Iterator[str]:
    """Every string in a JSON value, at any depth (where a secret could hide in a setting)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from strings_in(item)


def masked_strings(value: Any) -> Any:
    """A JSON value with each string in it masked as ``masked_param`` masks one (a password may hold quotes,
    spaces or '@', which a pass over the value's JSON text would misread)."""
    if isinstance(value, str):
        return masked_param(value)
    if isinstance(value, dict):
        return {key: masked_strings(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [masked_strings(item) for item in value]
    return value


def masked_param(value: Any, max_chars: int | None = None) -> Any:
    """``value`` as an MLflow param: numbers and booleans as they are, anything else as text (JSON for what is
    not a string; ``str`` for what JSON cannot write, a Path or a dtype), with credentials masked (a URI may carry
    user:password@ or ?token=) and cut to ``max_chars``."""
    if isinstance(value, int | float | bool):
        return value
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = redact_uri(text) if "://" in text else redact(text)
    if max_chars is not None and len(text) > max_chars:
        text = text[: max_chars - 12] + " ...(cut)"
    return text
