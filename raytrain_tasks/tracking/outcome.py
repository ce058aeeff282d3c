"""What a finished fit leaves in its MLflow run beside the per-epoch metrics: the summary (tags and a table in the
run's description) and one LoggedModel per kept checkpoint."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from raytrain_tasks.tracking.names import epoch_number
from raytrain_tasks.tracking.runs import NOTE_TAG

if TYPE_CHECKING:
    from mlflow import MlflowClient

SUMMARY_TAG_PREFIX = "summary."
RESULT_HEADING = "\n\n#### Result\n"


def log_summary(
    client: MlflowClient,
    run_id: str,
    history: list[dict[str, float]],
    metric: str,
    best_epoch: int,
    columns: Sequence[str],
) -> bool:
    """The best epoch (``best_epoch``, the number of the checkpoint the fit chose) and the final one, as tags
    (``summary.best_epoch``, ``summary.best_<metric>``, ``summary.final_<key>`` for every key the history holds:
    searchable, a column in the runs table) and a table of ``columns`` at the end of the run's description.

    Not as metrics: the MLflow UI draws every metric as a chart, and one-point charts of values the per-epoch
    curves already hold would sit among those curves. False (nothing logged) when ``history`` has no entry for
    ``best_epoch`` with ``metric``.
    """
    from mlflow.entities import RunTag

    best = next((entry for entry in history if epoch_number(entry["epoch"]) == best_epoch), None)
    if best is None or metric not in best:
        return False
    last = history[-1]
    summary = {"best_epoch": str(epoch_number(best["epoch"])), f"best_{metric}": f"{best[metric]:.6f}"}
    summary |= {f"final_{key}": f"{value:.6f}" for key, value in sorted(last.items()) if key != "epoch"}
    columns = [key for key in columns if key in last and key in best]
    table = [
        f"| epoch | {' | '.join(columns)} |",
        f"|---|{'---|' * len(columns)}",
        *(
            f"| {label} {epoch_number(entry['epoch'])} | {' | '.join(f'{entry[key]:.4f}' for key in columns)} |"
            for label, entry in ((f"best by {metric}:", best), ("final:", last))
        ),
    ]
    description = client.get_run(run_id).data.tags.get(NOTE_TAG, "").split(RESULT_HEADING, 1)[0]
    tags = [RunTag(SUMMARY_TAG_PREFIX + key, value) for key, value in summary.items()]
    tags.append(RunTag(NOTE_TAG, description + RESULT_HEADING + "\n".join(table)))
    client.log_batch(run_id, tags=tags)
    return True


CHECKPOINT_MODEL_TYPE = "checkpoint"  # the model_type of the LoggedModels that stand for kept checkpoints
CHECKPOINT_URI_TAG = "prefect_raytrain.checkpoint_uri"


def logged_model_name(folder: str) -> str:
    """The LoggedModel name of checkpoint folder ``folder``: the folder's name, with the characters MLflow refuses
    in a model name (Ray Train's ``checkpoint_2026-11-27_14-07-45.703975`` has a dot) as ``-``."""
    return re.sub(r"[/:.%\"']", "-", folder)


def log_checkpoint_models(
    client: MlflowClient,
    experiment_id: str,
    run_id: str,
    kept: dict[str, tuple[str, int]],
    digests: dict[str, str],
    metric_keys: Iterable[str],
) -> dict[str, str]:
    """Each checkpoint Ray Train kept, as an MLflow 3 LoggedModel of the run linked to its step's metrics;
    returns checkpoint folder name -> model_id. ``kept``: folder name -> (URI, the MLflow step of its report).

    In the experiment's Models tab the kept checkpoints are then rows with their epoch's metrics (``metric_keys`` of
    the run's history at that step), so the best one is a sort. The LoggedModel holds no copy of the weights: its
    tags say where the checkpoint is and its recorded digest. Idempotent: a retry or a resume finds the models an
    earlier attempt created, and links a metric once (MLflow skips a metric it already has). They are created once
    the fit is done, when Ray Train deletes no more checkpoints of the run (a resume cannot change ``epochs`` or
    ``checkpoints_to_keep``), so every one of them points to a checkpoint in storage.
    """
    from mlflow.entities import LoggedModelStatus, Metric

    existing = {model.name: model for model in _run_models(client, experiment_id, run_id)}
    keys = list(dict.fromkeys(metric_keys))
    histories = {key: {int(m.step): m for m in client.get_metric_history(run_id, key)} for key in keys}
    model_ids = {}
    for name, (uri, step) in sorted(kept.items()):
        model = existing.get(logged_model_name(name))
        if model is None:
            tags = {CHECKPOINT_URI_TAG: uri, "prefect_raytrain.epoch": str(step)}
            if name in digests:
                tags["prefect_raytrain.checkpoint_sha256"] = digests[name]
            model = client.create_logged_model(
                experiment_id,
                name=logged_model_name(name),
                source_run_id=run_id,
                tags=tags,
                model_type=CHECKPOINT_MODEL_TYPE,
            )
        if model.status != LoggedModelStatus.READY:
            # The run's own points (same timestamp, step and value), now also linked to the model.
            linked = [
                Metric(key, point.value, point.timestamp, point.step, model_id=model.model_id)
                for key in keys
                if (point := histories[key].get(step)) is not None
            ]
            client.log_batch(run_id, metrics=linked)
            client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        model_ids[name] = model.model_id
    return model_ids


def _run_models(client: MlflowClient, experiment_id: str, run_id: str) -> list[Any]:
    """Every checkpoint LoggedModel of the run, all pages (a page holds 100; a run may keep up to 1000)."""
    found: list[Any] = []
    token: str | None = None
    while True:
        page = client.search_logged_models(
            [experiment_id], filter_string=f"source_run_id = '{run_id}'", page_token=token
        )
        found += [model for model in page if model.model_type == CHECKPOINT_MODEL_TYPE]
        token = page.token
        if not token:
            return found


# What a TrainSpec's loop reports besides its losses and metrics (raytrain_tasks.trainspec.data.epoch_figures), and its
# test-split scores (the gate's; they pick nothing): in MLflow, but left off its epoch lines and summaries.
SPEC_LOOP_EXTRAS = ("test_", "epoch_seconds", "samples_per_second", "workers")


def headline(names: Iterable[str], left_off: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The metrics an epoch's line and a run's summary show: ``names`` but those ``left_off`` names or starts;
    the training figures first, then ``val_loss``, the other validation metrics, and the rest, each group by name."""
    kept = {name for name in names if not name.startswith(left_off)} if left_off else set(names)
    order = ("train_", "val_loss", "val_")
    return tuple(sorted(kept, key=lambda name: (next((i for i, s in enumerate(order) if name.startswith(s)), 3), name)))
