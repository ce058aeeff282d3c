"""What the Prefect run page shows: live epoch progress while training, and a summary at the end."""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from raytrain_tasks.redact import redact, redact_uri
from raytrain_tasks.tracking.controller import STEP_KEY

if TYPE_CHECKING:
    from mlflow import MlflowClient

POLL_SECONDS = 1.0


class EpochProgress:
    """Follows the epochs the controller commits to MLflow while ``fit()`` runs.

    Each newly committed epoch becomes one log line in the task's Prefect log and advances a progress
    artifact on the run page. Workers stay Prefect-free: the MLflow run is the only channel.
    """

    def __init__(
        self,
        client: MlflowClient,
        run_id: str,
        epochs: int,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        step_key: str = STEP_KEY,
        builtin: bool = True,
        expects: tuple[str, ...] = (),
    ) -> None:
        self.client, self.run_id, self.epochs, self.logger = client, run_id, epochs, logger
        # The user's own code: any metric it reported with a checkpoint marks a committed report, every one is
        # shown, and ``expects`` (the metrics its best checkpoint and the gate are chosen by) are looked for.
        self.step_key, self.builtin, self.expects = step_key, builtin, expects
        self._seen: set[int] = set()
        self._warned = False
        self._stop = threading.Event()
        self._artifact_id: Any = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EpochProgress:
        from prefect.artifacts import create_progress_artifact

        # Best effort: an MLflow or Prefect error here must not stop the fit, or replace its outcome.
        try:
            self._seen = self._committed_steps()  # a resumed run starts where it left off
            self._artifact_id = create_progress_artifact(
                progress=self._percent(), description=f"Epochs committed (checkpointed) of {self.epochs}"
            )
        except Exception as exc:  # noqa: BLE001 - the display is off; the fit goes on (tested)
            self.logger.warning(
                "epoch progress is not shown on the run page: %s", redact(f"{type(exc).__name__}: {exc}")
            )
            return self
        # Prefect's client settings live in context variables: the poller needs a copy of this context.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._poll_until_stopped,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return  # the display never started
        self._stop.set()
        self._thread.join(timeout=30)
        # Never raises: while the fit's own exception propagates (a cancellation, a CheckpointError), an error of
        # the display's last poll would replace it; after a fit that succeeded, it would fail it.
        try:
            self._poll_once()  # epochs committed in the last interval
        except Exception as error:  # noqa: BLE001 - tested with MLflow gone at the end of a fit
            self.logger.warning(
                "epoch progress on the run page may miss the last epochs: %s",
                redact(f"{type(error).__name__}: {error}"),
            )

    def _poll_until_stopped(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self._poll_once()
            except Exception:  # noqa: BLE001 - progress display must never fail the training task
                self.logger.debug("progress poll failed", exc_info=True)

    def _poll_once(self) -> None:
        from prefect.artifacts import update_progress_artifact

        if not self.builtin:
            histories = self._user_histories()
            new = sorted({step for history in histories.values() for step in history} - self._seen)
            if new:
                self._log_reported(new, histories)
                update_progress_artifact(self._artifact_id, progress=self._percent())
            return
        new = sorted(self._committed_steps() - self._seen)
        if not new:
            return
        histories = {
            key: {int(m.step): m.value for m in self.client.get_metric_history(self.run_id, key)}
            for key in ("train_loss", "val_loss", STEP_KEY, "epoch_seconds")
        }
        for step in new:
            self.logger.info(
                "epoch %d/%d committed: train_loss=%.4f val_loss=%.4f val_accuracy=%.4f (%.1f s)",
                step,  # the epoch number
                self.epochs,
                histories["train_loss"].get(step, float("nan")),
                histories["val_loss"].get(step, float("nan")),
                histories[STEP_KEY].get(step, float("nan")),
                histories["epoch_seconds"].get(step, float("nan")),
            )
            self._seen.add(step)
        update_progress_artifact(self._artifact_id, progress=self._percent())

    def _user_histories(self) -> dict[str, dict[int, float]]:
        keys = sorted(key for key in self.client.get_run(self.run_id).data.metrics if not key.startswith("system/"))
        return {key: {int(m.step): m.value for m in self.client.get_metric_history(self.run_id, key)} for key in keys}

    def _log_reported(self, new: list[int], histories: dict[str, dict[int, float]]) -> None:
        for step in new:
            values = " ".join(f"{key}={history[step]:.4f}" for key, history in histories.items() if step in history)
            self.logger.info("epoch %d/%d committed: %s", step, self.epochs, values)
            self._seen.add(step)
        missing = [name for name in self.expects if name not in histories]
        if missing and not self._warned:
            # Said at the first epoch instead of after the last: the run fails then unless a later report has them.
            self._warned = True
            self.logger.warning(
                "train_code reported %s with its checkpoint but not %s, which TrainFunc(metric=..., gate_metric=...) "
                "names: the best checkpoint and the gate need it, so the run fails at its end unless a later report "
                "has it. Stop it now (Ctrl-C; nothing is registered) and fix the name if it is a typo",
                sorted(histories) or "nothing",
                missing,
            )

    def _committed_steps(self) -> set[int]:
        if not self.builtin:
            return {step for history in self._user_histories().values() for step in history}
        return {int(m.step) for m in self.client.get_metric_history(self.run_id, self.step_key)}

    def _percent(self) -> float:
        return round(100.0 * len(self._seen) / self.epochs, 1)


LEARNING_CURVES = "evaluation/learning_curves.png"  # logged by raytrain_driver.evaluation


def mlflow_ui_base(tracking_uri: str) -> str | None:
    """The MLflow server's address, when the tracking URI is one (its UI and artifact routes live there)."""
    tracking_uri = redact_uri(tracking_uri)
    if "***" in tracking_uri or not tracking_uri.startswith(("http://", "https://")):
        return None  # a local store has no UI to link to; a masked password would make a dead link
    return tracking_uri.rstrip("/")


def mlflow_run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    base = mlflow_ui_base(tracking_uri)
    if base:
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
    tracking_uri = redact_uri(tracking_uri)
    return f"run `{run_id}` in `{tracking_uri}` (browse with `mlflow ui --backend-store-uri {tracking_uri}`)"


def mlflow_version_link(tracking_uri: str, name: str, version: str) -> str:
    base = mlflow_ui_base(tracking_uri)
    label = f"`{name}` version **{version}**"
    return f"[{label}]({base}/#/models/{quote(name)}/versions/{version})" if base else label


def learning_curves_url(tracking_uri: str, run_id: str) -> str | None:
    """Where the MLflow server serves the run's learning-curve image (the route its UI uses)."""
    base = mlflow_ui_base(tracking_uri)
    return f"{base}/get-artifact?path={quote(LEARNING_CURVES)}&run_uuid={run_id}" if base else None


def publish_run_summary(result: Any, registry_error: str = "") -> None:
    """Artifacts on the flow run: a markdown summary (final metrics, links to the MLflow run and the registered
    version, where things are, what the registry decided) and, with an MLflow server, the learning curves."""
    from prefect.artifacts import create_image_artifact, create_markdown_artifact

    from raytrain_tasks.prepared import is_builtin_dataset

    fit, model, config = result.fit, result.model, result.config
    data = result.dataset
    builtin = is_builtin_dataset(data)
    shown = ("train_loss", "val_loss", "val_accuracy") if builtin else tuple(sorted(fit.final_metrics))
    rows = "\n".join(
        f"| {key} | {fit.final_metrics[key]:.4f} | {fit.best_metrics.get(key, float('nan')):.4f} |"
        for key in shown
        if key in fit.final_metrics
    )
    if registry_error:
        registry = f"**register-model failed, no alias moved**: {redact(registry_error)}"
    elif model is None:
        registry = "not registered (`register` is off)"
    else:
        version = mlflow_version_link(config.mlflow_tracking_uri, model.name, str(model.version))
        registry = f"{version} -> {', '.join(model.aliases)} ({model.decision}: {model.reason})"
    if not builtin:  # the user's own training code: its gate metric is what it reported
        gate = ", ".join(f"{k} {v:.4f}" for k, v in fit.scores.items())
        lines = f"- **Gate metric** (the best checkpoint's report): {gate}\n- **Training code**: `{config.train_code}`"
        if data is not None:
            lines += (
                f"\n- **Prepared data**: `{data.content_hash}` ({data.files} files, {data.bytes} bytes) at {data.uri}"
            )
    else:
        split_sizes = f"{data.train_rows} train / {data.val_rows} val / {data.test_rows} test rows"
        scores = ", ".join(f"{k} {v:.4f}" for k, v in fit.scores.items() if k.startswith("test_")) or "not scored"
        lines = (
            f"- **Test split** (held out, compared for promotion): {scores}\n"
            f"- **Dataset**: `{data.uri}` ({split_sizes})"
        )
    curves = learning_curves_url(config.mlflow_tracking_uri, fit.mlflow_run_id)
    where_curves = f"![learning curves]({curves})" if curves else f"`{LEARNING_CURVES}` in the MLflow run"
    markdown = f"""# Training run `{result.run_key}`

| metric | final (epoch {fit.epochs_completed}) | best (epoch {fit.best_epoch}) |
|---|---|---|
{rows}

- **MLflow**: {mlflow_run_link(config.mlflow_tracking_uri, fit.mlflow_experiment_id, fit.mlflow_run_id)}
- **Learning curves**: {where_curves}
- **Model**: {registry}
- **Checkpoints**: `{fit.run_uri}` (best: `{fit.best_checkpoint_uri}`)
{lines}
- **Workers**: {config.num_workers} x {fit.backend}; continue an interrupted run with `resume={result.run_key}`
"""
    create_markdown_artifact(markdown, key="training-summary", description=f"Run {result.run_key}")
    if curves:
        create_image_artifact(
            image_url=curves,
            key="learning-curves",
            description=f"Run {result.run_key}: loss and accuracy per epoch (best epoch {fit.best_epoch})",
        )
