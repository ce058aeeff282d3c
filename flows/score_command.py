"""`prefect-raytrain score --model models:/NAME@champion --input PATH --output PATH`: the scoring flow once, every
ScoringConfig field a kebab-case flag."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any, cast

from prefect.exceptions import TerminationSignal
from prefect.states import State
from pydantic import ValidationError

from flows.cli import credentials_to_environment, local_services
from flows.console import quiet_console
from raytrain_tasks.config import describe_validation_error
from raytrain_tasks.errors import ClusterError, ScoringInputError, SettingsError
from raytrain_tasks.redact import redact, redact_uri
from raytrain_tasks.scoring.config import ScoringConfig

# The command's short names for the flow's parameters.
ALIASES = {"input_path": "--input", "output_path": "--output"}
AGAIN = "run the same command again: an output is written whole or not at all"


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Score a table with a registered model into one Parquet file (the `score` flow, once).",
        allow_abbrev=False,
    )
    for name, field in ScoringConfig.model_fields.items():
        flags = [ALIASES[name]] if name in ALIASES else []
        flags.append("--" + name.replace("_", "-"))
        options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": field.description}
        if field.annotation is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif field.annotation in (int, float, str):
            options["type"] = field.annotation
        options["required"] = field.is_required()
        parser.add_argument(*flags, **options)
    parser.add_argument("--verbose", action="store_true", help="Show Ray's, MLflow's and Prefect's own messages.")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "prefect-raytrain score") -> int:
    from flows.scoring import scoring_pipeline

    parser = build_parser(prog)
    given = vars(parser.parse_args(argv))
    verbose = bool(given.pop("verbose"))
    try:
        config = ScoringConfig(**given)
    except ValidationError as exc:
        parser.exit(2, describe_validation_error(exc) + "\n")
    config = credentials_to_environment(config)
    if not verbose:
        quiet_console()
    try:
        with local_services(config):
            # return_state reaches Prefect, not the flow's **settings: a State, whatever its annotation says.
            state = cast(State, scoring_pipeline(**config.model_dump(), return_state=True))
    except ClusterError as exc:
        print(f"\nscoring failed: {redact(str(exc))}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, TerminationSignal) as exc:
        signum = exc.signal if isinstance(exc, TerminationSignal) else signal.SIGINT
        print(f"\nscoring stopped by {signal.Signals(signum).name}: {AGAIN}", file=sys.stderr)
        return 128 + signum
    if not state.is_completed():
        failure = state.result(raise_on_failure=False)
        print(f"\nscoring {(state.name or 'failed').lower()}: {redact(str(failure))}", file=sys.stderr)
        if not isinstance(failure, ScoringInputError | SettingsError):  # a refusal fails the same way again
            print(f"\n{AGAIN}", file=sys.stderr)
        return 1
    result = state.result()
    done = "already held" if result.already_written else "now holds"
    print(
        f"{redact_uri(result.output_path)} {done} {result.rows} predictions of {result.model} version "
        f"{result.version} (input sha256 {result.input_sha256[:12]}, MLflow run {result.mlflow_run_id})"
    )
    return 0
