"""What the Prefect run page shows: live epoch progress while training, and a summary at the end."""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from raytrain_driver.hooks import EpochView
from raytrain_tasks.redact import redact, redact_uri
from raytrain_tasks.tracking.names import STEP_SERIES
from raytrain_tasks.tracking.outcome import headline

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
        view: EpochView | None = None,
    ) -> None:
        self.client, self.run_id, self.epochs, self.logger = client, run_id, epochs, logger
        # What the training code's committed epochs are marked by and show (raytrain_driver.hooks.EpochView).
        self.view = view or EpochView()
        self._seen: set[int] = set()
        self._warned = False
        self._past_epochs_warned = False
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

        # The marker first, the rest only once it has new steps: an epoch is shown whole, after its marker.
        marker = self.view.marker
        histories = self._histories([marker]) if marker is not None else self._histories()
        new = sorted(self._steps(histories) - self._seen)
        if not new:
            return
        if marker is not None:
            histories = self._histories()
        self._log_committed(new, histories)
        update_progress_artifact(self._artifact_id, progress=self._percent())

    def _histories(self, keys: list[str] | None = None) -> dict[str, dict[int, float]]:
        if keys is None:
            metrics = self.client.get_run(self.run_id).data.metrics
            keys = sorted(key for key in metrics if not key.startswith(("system/", STEP_SERIES)))  # by epoch only
        return {key: {int(m.step): m.value for m in self.client.get_metric_history(self.run_id, key)} for key in keys}

    def _steps(self, histories: dict[str, dict[int, float]]) -> set[int]:
        if self.view.marker is not None:
            return set(histories.get(self.view.marker, {}))
        return {step for history in histories.values() for step in history}

    def _log_committed(self, new: list[int], histories: dict[str, dict[int, float]]) -> None:
        shown = self.view.shown or headline(histories, self.view.left_off)
        for step in new:
            values = " ".join(f"{key}={histories[key][step]:.4f}" for key in shown if step in histories.get(key, {}))
            seconds = histories.get("epoch_seconds", {}).get(step) if "epoch_seconds" not in shown else None
            took = f" ({seconds:.1f} s)" if seconds is not None else ""
            self.logger.info("epoch %d/%d committed: %s%s", step, self.epochs, values, took)
            self._seen.add(step)
            if step > self.epochs and not self._past_epochs_warned:
                self._past_epochs_warned = True
                self.logger.warning(
                    "train_code committed step %d of `epochs` %d: it trains on past `epochs` (--epochs), which "
                    "your code gets as config['epochs']: read that in your loop (not a key of your own, such as "
                    "num_epochs), or report `epoch` with each checkpoint if it checkpoints more than once an epoch; "
                    "the progress, `runs` and a resume count to `epochs`",
                    step,
                    self.epochs,
                )
        missing = [name for name in self.view.expects if name not in histories]
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
        marker = self.view.marker
        return self._steps(self._histories([marker]) if marker is not None else self._histories())

    def _percent(self) -> float:
        return min(100.0, round(100.0 * len(self._seen) / self.epochs, 1))  # code training past `epochs` stops at 100


# Every fit logs it (raytrain_tasks.reports.log_learning_curves; its name not imported: reports loads Ray Train).
LEARNING_CURVES = "evaluation/learning_curves.png"


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

    from raytrain_driver.origin import trained_what

    fit, model, config = result.fit, result.model, result.config
    shown = fit.shown_metrics or tuple(sorted(fit.final_metrics))
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
    scores = ", ".join(f"{k} {v:.4f}" for k, v in fit.scores.items()) or "not scored"
    data = result.dataset.describe() if result.dataset is not None else "read by the training code itself"
    lines = (
        f"- **Scores** of the best checkpoint (the gate compares its held-out one): {scores}\n"
        f"- **Trains**: {trained_what(config)}\n- **Data**: {data}"
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
