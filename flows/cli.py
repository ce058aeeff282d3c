"""`python -m flows.training --num-workers 2 --epochs 3 ...`: every config field as a kebab-case flag."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from raytrain_tasks.config import TrainingConfig, describe_validation_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flows.training",
        description="Run the training pipeline (prepare-data -> distributed-fit -> register-model) once.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, field in TrainingConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = field.description or field.title or name
        options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        if annotation is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif origin is list:
            options["type"] = _int_list
            options["metavar"] = "N,N,..."
        elif origin is typing.Literal:
            options["choices"] = typing.get_args(annotation)
        elif isinstance(annotation, type) and annotation in (int, float, str):
            options["type"] = annotation
        elif isinstance(annotation, types.UnionType):  # pragma: no cover - no such field today
            options["type"] = str
        parser.add_argument(flag, **options)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> TrainingConfig:
    """The config the flags describe; exits with status 2 and the invalid fields named otherwise."""
    parser = build_parser()
    overrides = vars(parser.parse_args(argv))
    try:
        return TrainingConfig(**overrides)
    except ValidationError as exc:
        parser.exit(2, describe_validation_error(exc) + "\n")


def main(pipeline: Callable[..., Any], argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    state = pipeline(config=config, return_state=True)
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        print(f"\npipeline {state.name.lower()}: {error}", file=sys.stderr)
        return 1
    print(format_summary(state.result()))
    return 0


def format_summary(result: Any) -> str:
    fit, model = result.fit, result.model
    final = fit.final_metrics
    lines = [
        "",
        "training pipeline finished",
        f"  run key        {result.run_key}",
        f"  MLflow run     {fit.mlflow_run_id} (experiment {result.config.experiment_name!r}, "
        f"{result.config.mlflow_tracking_uri})",
        f"  epochs         {fit.epochs_completed}, {result.config.num_workers} workers ({fit.backend})",
        f"  final metrics  val_accuracy={final.get('val_accuracy', float('nan')):.4f} "
        f"val_loss={final.get('val_loss', float('nan')):.4f} train_loss={final.get('train_loss', float('nan')):.4f}",
        f"  checkpoints    {fit.run_uri} (best: epoch {fit.best_epoch})",
    ]
    if model is None:
        lines.append("  model          not registered (--no-register)")
    else:
        aliases = ", ".join(model.aliases) or "no alias"
        lines.append(f"  model          {model.name} version {model.version} -> {aliases} ({model.reason})")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
