"""`prefect-raytrain sweep --search JSON --trials N [training flags]`: the sweep flow once. The training flags are
`train`'s (every setting), the sweep's settings for every trial; `--search` says what varies between trials."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import cast

from prefect.exceptions import TerminationSignal
from prefect.states import State

from flows.cli import credentials_to_environment, local_services, parse_args
from flows.console import quiet_console
from raytrain_tasks.config import TrainingConfig, parameters_of
from raytrain_tasks.errors import ClusterError
from raytrain_tasks.redact import redact


def _sweep_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    parser.add_argument("--search", required=True, help="What varies between trials, as JSON (docs/sweeps.md).")
    parser.add_argument("--trials", type=int, default=4, help="Draws of the search (default: 4).")
    parser.add_argument("--grace-period", type=int, default=1, help="Epochs before ASHA may stop a trial.")
    parser.add_argument("--sweep-key", default="", help="Continue a killed sweep: its finished trials are kept.")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "prefect-raytrain sweep") -> int:
    from flows.sweep import sweep_pipeline

    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        _sweep_parser(prog).print_help()
        print("\nand every flag of `prefect-raytrain train`: the settings of every trial.")
        return 0
    sweep, rest = _sweep_parser(prog).parse_known_args(args)
    config, verbose = parse_args(rest, prog)
    config = credentials_to_environment(config)
    if problem := _search_problem(config, sweep.search, sweep.grace_period):  # in seconds, before Prefect and Ray
        print(f"\nsweep failed: {redact(problem)}", file=sys.stderr)
        return 2
    if not verbose:
        quiet_console()
    parameters = {"search": sweep.search, "trials": sweep.trials, "grace_period": sweep.grace_period}
    parameters["sweep_key"] = sweep.sweep_key
    try:
        with local_services(config):
            # return_state reaches Prefect, not the flow's **settings: a State, whatever its annotation says.
            state = cast(State, sweep_pipeline(**parameters_of(config), **parameters, return_state=True))
    except ClusterError as exc:
        print(f"\nsweep failed: {redact(str(exc))}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, TerminationSignal) as exc:
        signum = exc.signal if isinstance(exc, TerminationSignal) else signal.SIGINT
        print(
            f"\nsweep stopped by {signal.Signals(signum).name}: continue it with --sweep-key <its key>", file=sys.stderr
        )
        return 128 + signum
    if not state.is_completed():
        error = redact(str(state.result(raise_on_failure=False)))
        print(f"\nsweep {(state.name or 'failed').lower()}: {error}", file=sys.stderr)
        return 1
    print(_summary(state.result()))
    return 0


def _search_problem(config: TrainingConfig, search: str, grace_period: int) -> str:
    """Why the search (or the sweep's settings, or its code) cannot run; "" if it can. The flow checks it again."""
    from raytrain_driver.sweep_run import plan_search
    from raytrain_tasks.errors import SettingsError, UserCodeError

    try:
        plan_search(config, search, grace_period)
    except (SettingsError, UserCodeError) as exc:
        return str(exc)
    return ""


def _summary(result: object) -> str:
    outcome, model = result.outcome, result.model  # type: ignore[attr-defined]
    lines = [f"sweep {outcome.sweep_key} (MLflow run {outcome.parent_run_id})"]
    for row in outcome.trials:
        ended = "finished" if row["finished"] else f"{row.get('ended') or 'stopped'} after {row['epochs']} epochs"
        shown = {k: v for k, v in row.items() if k not in ("run_key", "epochs", "finished", "ended")}
        settings = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        lines.append(f"  {row['run_key']}  {settings}  {ended}")
    if outcome.best_run_key is None:
        lines.append("  best: none (no trial trained every epoch); nothing registered")
    else:
        lines.append(f"  best: {outcome.best_run_key}")
        if model is not None:
            aliases = ", ".join(model.aliases) or "no alias"
            lines.append(f"  model: {model.name} version {model.version} -> {aliases} ({model.reason})")
    return "\n".join(lines)
