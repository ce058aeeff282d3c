"""`prefect-raytrain`: train, list runs, resume one, open the MLflow UI.

    prefect-raytrain train [--epochs 3 ...]          the pipeline once (every config field is a flag, as in
                                                     `python -m flows.training`)
    prefect-raytrain runs                            recent runs: run key, state, epochs done of planned,
                                                     resumable or not, MLflow run id
    prefect-raytrain resume RUN_KEY [--flag ...]     continue a run with the settings it started with
    prefect-raytrain ui [--port 5000]                the MLflow UI over the local store
    prefect-raytrain gc [--older-than 24] [--apply]  what no run needs any more, on this node and in storage:
                                                     listed (a dry run), or removed with --apply
    prefect-raytrain score --model models:/NAME@champion --input PATH --output PATH.parquet
                                                     predictions of every input row with the model, one
                                                     Parquet file (local or s3://), recorded in MLflow
    prefect-raytrain sweep --search JSON --trials N  a hyperparameter search on Ray Tune: each trial the
                                                     pipeline's fit; the best through the promotion gate
    prefect-raytrain champions NAME                  who was champion when: every move of NAME@champion
    prefect-raytrain rollback NAME --to VERSION --reason TEXT
                                                     move NAME@champion back, recorded with the reason

`runs`, `resume`, `ui` and `gc` find the runs with the same `--mlflow-tracking-uri`, `--experiment-name` and
`--storage-path` flags as `train` (and the same defaults); `champions` and `rollback` take `--mlflow-tracking-uri`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.environment import embedded_prefect_home
from raytrain_tasks.redact import MASK, redact_uri
from raytrain_tasks.settings import DEFAULT_STATE_DIR
from raytrain_tasks.tracking.names import LAST_STEP_TAG, STEP_SERIES

PROG = "prefect-raytrain"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in ("train", "resume", "gc"):  # gc finds the pin journals where train and resume keep them
        embedded_prefect_home(DEFAULT_STATE_DIR)
    if command == "train":
        from flows.cli import main as train
        from flows.training import training_pipeline

        return train(training_pipeline, rest, prog=f"{PROG} train")
    if command == "runs":
        return runs(rest)
    if command == "resume":
        return resume(rest)
    if command == "ui":
        return ui(rest)
    if command == "gc":
        return gc(rest)
    if command == "score":
        from flows.score_command import main as score

        return score(rest, prog=f"{PROG} score")
    if command == "sweep":
        embedded_prefect_home(DEFAULT_STATE_DIR)
        from flows.sweep_command import main as sweep

        return sweep(rest, prog=f"{PROG} sweep")
    if command in ("champions", "rollback"):  # the champion's history, and moving it back
        from flows.champions_command import champions, rollback

        return champions(rest) if command == "champions" else rollback(rest)
    known = "train, runs, resume, ui, gc, score, sweep, champions, rollback"
    print(f"{PROG}: unknown command {command!r}; one of: {known}", file=sys.stderr)
    return 2


def _location_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags that say where runs are, with `train`'s defaults."""
    parser = argparse.ArgumentParser(prog=f"{PROG} {prog}", description=description)
    fields = TrainingConfig.model_fields
    for name in ("mlflow_tracking_uri", "experiment_name", "storage_path"):
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, default=fields[name].default, help=fields[name].description
        )
    return parser


def _locations(args: argparse.Namespace) -> TrainingConfig:
    config = TrainingConfig(
        mlflow_tracking_uri=args.mlflow_tracking_uri,
        experiment_name=args.experiment_name,
        storage_path=args.storage_path,
    )
    return config.resolved(Path.cwd(), os.environ)


def _experiment(config: TrainingConfig) -> tuple[Any, Any]:
    """(a connected MLflow client, the experiment the locations name, or None when it does not exist yet)."""
    from raytrain_tasks.tracking import runs as tracking

    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    return client, client.get_experiment_by_name(config.experiment_name)


def _experiment_runs(config: TrainingConfig, limit: int) -> tuple[Any, list[Any]]:
    """(a connected MLflow client, the experiment's runs of this pipeline, newest first)."""
    from raytrain_tasks.tracking import runs as tracking

    client, experiment = _experiment(config)
    if experiment is None:
        return client, []
    found = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=limit)
    return client, [run for run in found if tracking.RUN_KEY_TAG in run.data.tags]


def committed_epochs(client: Any, run: Any) -> int:
    """Epochs (checkpointed reports) the run committed, each logged once at its step: the steps of whichever of
    its metrics has the most (a metric reported only now and then has fewer)."""
    keys = [key for key in run.data.metrics if not key.startswith(("system/", STEP_SERIES))]
    return max((len({m.step for m in client.get_metric_history(run.info.run_id, key)}) for key in keys), default=0)


def describe_run(client: Any, run: Any) -> dict[str, str]:
    """What `runs` shows of one MLflow run of the pipeline."""
    from raytrain_tasks.tracking import run_owner
    from raytrain_tasks.tracking import runs as tracking

    status = run.info.status
    state = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "stopped"}.get(status, status.lower())
    if status == "RUNNING":
        alive = run_owner.driver_alive(run.data.tags.get(run_owner.DRIVER_TAG, ""))
        state = {True: "running", False: "interrupted", None: "running (other host)"}[alive]
    done = committed_epochs(client, run)
    planned = run.data.params.get("epochs", "?")
    if state in ("failed", "stopped", "interrupted"):
        # `resume` continues either way: from the last checkpoint, or from epoch 1 in the same MLflow run.
        resumable = "yes" if done else "yes (from epoch 1)"
        if step := run.data.tags.get(LAST_STEP_TAG):  # the newest checkpoint's step, within an epoch or at its end
            resumable = f"yes (after step {step})"
        if run.data.tags.get(tracking.ERROR_TAG, "").startswith("UserCodeError"):
            resumable = "after a code fix"  # its error says so; a train_config at fault needs a new run instead
    else:
        resumable = "-"
    if not state.startswith("running"):
        state, resumable = registration_left(client, run) or (state, resumable)
    params = run.data.params
    return {
        "run key": run.data.tags[tracking.RUN_KEY_TAG],
        "trains": params.get("train_code") or f"{params.get('model', '?')} on {params.get('dataset', '?')}",
        "state": state,
        "epochs": f"{done}/{planned}",
        "resumable": resumable,
        "MLflow run": run.info.run_id,
        "started": datetime.fromtimestamp(run.info.start_time / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


WAITING_FOR_REGISTRATION = "waiting for registration"


def registration_left(client: Any, run: Any) -> tuple[str, str] | None:
    """(state, resumable) of a run whose fit finished and whose registration was not applied (register-model
    failed or was killed); None for any other run. Its resume trains nothing and finishes the registration."""
    from raytrain_driver.origin import registered_version
    from raytrain_driver.promotion import NOT_COMPARABLE, Promotion
    from raytrain_driver.register import APPLIED_TAG
    from raytrain_tasks.tracking import runs as tracking

    params, tags = run.data.params, run.data.tags
    # The fit record's digest reaches MLflow once the fit has finished (raytrain_driver/fit_record.py).
    if tracking.FIT_RECORD_TAG not in tags or not params.get("model_name"):
        return None
    found = registered_version(client, params["model_name"], tags[tracking.RUN_KEY_TAG])
    version = dict(found.tags) if found is not None else None
    if version is None:  # a run started with register off registers only when a resume turns it on
        return (WAITING_FOR_REGISTRATION, "yes") if params.get("register") == "True" else None
    if version.get(APPLIED_TAG) == "true":
        return None
    if version.get("promotion.decision") == Promotion.UNDECIDED.value and NOT_COMPARABLE in version.get(
        "promotion.reason", ""
    ):
        return "not registered", "no (score not comparable)"  # a resume reads the same score
    return WAITING_FOR_REGISTRATION, "yes"


def runs(argv: Sequence[str]) -> int:
    parser = _location_parser("runs", "Recent runs of the pipeline, newest first.")
    parser.add_argument("--limit", type=int, default=20, help="How many runs to show.")
    args = parser.parse_args(argv)
    config = _locations(args)
    client, found = _experiment_runs(config, args.limit)
    where = f"experiment {config.experiment_name!r} at {redact_uri(config.mlflow_tracking_uri)}"
    if not found:
        print(f"no runs in {where}")
        return 0
    rows = [describe_run(client, run) for run in found]
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(row[c]) for row in rows)) for c in columns}
    print(f"runs in {where}:")
    print("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip())
    for row in rows:
        print("  ".join(row[c].ljust(widths[c]) for c in columns).rstrip())
    if any(row["resumable"] != "-" for row in rows):
        print(f"\ncontinue one with: {PROG} resume <run key>")
    return 0


def flags_from_params(params: dict[str, str], given: Sequence[str]) -> list[str]:
    """`train` flags that rebuild the config a run logged as MLflow params (all but ``resume``).

    A value the params hold masked (a password in a URI) must be given again among ``given``."""
    flags = []
    for name, field in TrainingConfig.model_fields.items():
        if name == "resume" or name not in params:
            continue
        flag, value = "--" + name.replace("_", "-"), params[name]
        if MASK in value:
            if not any(arg == flag or arg.startswith(flag + "=") for arg in given):
                raise SystemExit(f"{PROG} resume: the run's {name} was logged masked ({value}); pass {flag} again")
            continue
        if field.annotation is bool:
            flags.append(flag if value == "True" else "--no-" + flag[2:])
        else:
            flags.append(f"{flag}={value}")
    return flags


def resume(argv: Sequence[str]) -> int:
    parser = _location_parser(
        "resume",
        "Continue a run from its last checkpoint, in the same MLflow run, with the settings it started with. "
        "Other `train` flags after the run key change settings a resume may change (e.g. --no-register).",
    )
    parser.add_argument("run_key", help="The run key `runs` lists (also printed when the run started).")
    args, extra = parser.parse_known_args(argv)
    config = _locations(args)
    from raytrain_tasks.tracking import runs as tracking

    client, experiment = _experiment(config)
    run = None if experiment is None else tracking.find_run(client, experiment.experiment_id, args.run_key)
    if run is None:
        print(
            f"{PROG} resume: no run with run key {args.run_key} in experiment {config.experiment_name!r} at "
            f"{redact_uri(config.mlflow_tracking_uri)}; `{PROG} runs` lists them",
            file=sys.stderr,
        )
        return 2
    from flows.cli import main as train
    from flows.training import training_pipeline

    flags = flags_from_params(run.data.params, extra)
    return train(training_pipeline, [*flags, *extra, "--resume", args.run_key], prog=f"{PROG} resume")


def gc(argv: Sequence[str]) -> int:
    parser = _location_parser(
        "gc",
        "Remove what no run can still need: this node's copies of prepared data and checkpoint staging folders, "
        "checkpoint folders never committed, files of interrupted writes, and pin journals MLflow has caught up "
        "with. Prints what it would remove, and removes nothing unless --apply.",
    )
    endpoint = TrainingConfig.model_fields["s3_endpoint_url"]
    parser.add_argument("--s3-endpoint-url", dest="s3_endpoint_url", default="", help=endpoint.description)
    parser.add_argument(
        "--older-than",
        type=float,
        default=24.0,
        metavar="HOURS",
        help="Leave anything changed or used more recently than this (default: 24).",
    )
    parser.add_argument("--apply", action="store_true", help="Remove what is listed (without it: a dry run).")
    args = parser.parse_args(argv)
    if args.older_than < 0:
        parser.error("--older-than must be 0 or more hours")
    config = TrainingConfig(
        mlflow_tracking_uri=args.mlflow_tracking_uri,
        experiment_name=args.experiment_name,
        storage_path=args.storage_path,
        s3_endpoint_url=args.s3_endpoint_url,
    ).resolved(Path.cwd(), os.environ)
    from flows.gc_command import sweep

    return sweep(config, args.older_than * 3600, args.apply)


def ui(argv: Sequence[str]) -> int:
    parser = _location_parser("ui", "The MLflow UI over the pipeline's tracking store (runs until Ctrl-C).")
    parser.add_argument("--port", type=int, default=5000, help="Port of the MLflow UI on 127.0.0.1.")
    args = parser.parse_args(argv)
    config = _locations(args)
    uri = config.mlflow_tracking_uri
    prefect_ui = _prefect_ui_url()
    if prefect_ui:
        print(f"Prefect UI: {prefect_ui}")
    if uri.startswith(("http://", "https://")):
        print(f"MLflow UI: {redact_uri(uri)} (the tracking server serves it)")
        return 0
    print(f"MLflow UI: http://127.0.0.1:{args.port} over {redact_uri(uri)} (Ctrl-C stops it)", flush=True)
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri]
    os.execv(sys.executable, [*command, "--host", "127.0.0.1", "--port", str(args.port)])
    return 0  # pragma: no cover - execv does not return


def _prefect_ui_url() -> str:
    """Where Prefect's UI is, when this process is configured for a Prefect server."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    return str(PREFECT_UI_URL.value() or "") if PREFECT_API_URL.value() else ""


if __name__ == "__main__":
    raise SystemExit(main())
