"""Long runs: what checkpoints within an epoch cost, and what a kill, a frozen worker and a SIGTERM cost with them.

    python -m bench.long_runs

Real flows, one after another (a local Ray of 2 CPUs, a temporary Prefect API, MLflow on SQLite), of the table
classifier on a synthetic table sized so that an epoch has a few hundred steps on 2 cores. Figures:

- checkpoint share of step time at every 50 steps: the epochs' seconds with ``checkpoint_every_steps`` 50 against 0,
  medians of two runs each (goal <= 3%);
- work lost to a SIGKILL of a worker at a random moment of epoch 2: seconds from the last checkpoint committed
  before the kill to the kill, with checkpoints every 50 steps and at epoch ends only;
- SIGSTOP of a worker -> the first resumed step, with ``hang_timeout_s`` 30 (goal <= 30 s + 1.2x a fresh worker
  group start, bench.recovery's): the first checkpoint the restarted group commits, less the time its 50 steps took;
- SIGTERM to a worker -> the checkpoint it asked for is committed (pinned in MLflow);
- the floor under the first figure: the same checkpoints every 50 steps from a bare Ray Train loop of the same
  model (``ray.train.report`` alone: its barrier and its copy to storage).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from bench.recovery import training_workers

EVERY = 50
HANG_TIMEOUT_S = 30.0
SHARE_TARGET = 0.03
WORKLOAD = {"dataset": "synthetic", "synthetic_samples": 40_000, "synthetic_features": 64, "hidden_sizes": [512, 512]}


def _config(workdir: Path, **settings: Any) -> Any:
    from raytrain_tasks.config import TrainingConfig

    return TrainingConfig(
        train_config=WORKLOAD,
        epochs=3,
        batch_size=64,
        storage_path=str(workdir / "storage"),
        mlflow_tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}",
        register=False,
        **settings,
    )


class Flow:
    """One run of the flow in a thread; what MLflow says of it meanwhile."""

    def __init__(self, pool: ThreadPoolExecutor, config: Any) -> None:
        from mlflow import MlflowClient

        from flows.training import training_pipeline
        from raytrain_tasks.config import parameters_of

        self.config = config
        self.client = MlflowClient(config.mlflow_tracking_uri)
        run = partial(training_pipeline, **parameters_of(config))
        self.future = pool.submit(contextvars.copy_context().run, run)

    def run_id(self) -> str | None:
        experiment = self.client.get_experiment_by_name(self.config.experiment_name)
        runs = self.client.search_runs([experiment.experiment_id]) if experiment else []
        return runs[0].info.run_id if runs else None

    def points(self, key: str) -> list[tuple[int, float]]:
        """(step, commit time) of ``key``'s points, oldest first."""
        run_id = self.run_id()
        if run_id is None:
            return []
        return sorted((int(m.step), m.timestamp / 1000) for m in self.client.get_metric_history(run_id, key))

    def wait(self, ready: Callable[[], bool], what: str) -> None:
        while not ready():
            if self.future.done():
                raise SystemExit(f"the run ended before {what}: {self.future.result()}")
            time.sleep(0.02)

    def finish(self) -> Any:
        result = self.future.result(timeout=900)
        if not hasattr(result, "fit"):
            raise SystemExit(f"the run did not complete: {result}")
        return result


def _epoch_seconds(flow: Flow) -> float:
    return sum(value for _, value in _values(flow, "epoch_seconds"))


def _values(flow: Flow, key: str) -> list[tuple[int, float]]:
    run_id = flow.run_id()
    assert run_id is not None
    return sorted((int(m.step), m.value) for m in flow.client.get_metric_history(run_id, key))


def _signal_a_worker(flow: Flow, signum: int) -> float:
    """Send ``signum`` to one Ray Train worker at a random moment of epoch 2; the time it was sent."""
    flow.wait(lambda: 1 in {step for step, _ in flow.points("val_accuracy")}, "epoch 1 was committed")
    epoch_s = _values(flow, "epoch_seconds")[0][1]
    time.sleep(random.uniform(0.2, 0.8) * epoch_s)
    workers = training_workers()
    if not workers:
        raise SystemExit("no ray::RayTrainWorker process under this process")
    sent = time.time()
    workers[-1].send_signal(signum)
    return sent


def _lost(commits: list[float], sent: float) -> float:
    """Seconds between the last commit before ``sent`` and ``sent``: the training a kill then throws away."""
    return sent - max(t for t in commits if t <= sent)


def measure(pool: ThreadPoolExecutor, root: Path) -> dict[str, float]:
    from raytrain_tasks.tracking.names import STEP_SERIES

    figures: dict[str, Any] = {}
    seconds: dict[int, list[float]] = {0: [], EVERY: []}
    for repeat in range(2):
        for every in (0, EVERY):
            flow = Flow(pool, _config(root / f"share-{every}-{repeat}", checkpoint_every_steps=every))
            flow.finish()
            seconds[every].append(_epoch_seconds(flow))
            if every:
                figures["checkpoints_per_run"] = len(flow.points(STEP_SERIES)) - 3  # less the epochs' own
    base, with_steps = statistics.median(seconds[0]), statistics.median(seconds[EVERY])
    figures |= {"epochs_s_at_epoch_ends": base, f"epochs_s_every_{EVERY}": with_steps}
    figures["checkpoint_share"] = (with_steps - base) / base

    for every in (0, EVERY):
        flow = Flow(pool, _config(root / f"kill-{every}", checkpoint_every_steps=every, checkpoints_to_keep=100))
        sent = _signal_a_worker(flow, signal.SIGKILL)
        flow.finish()
        key = STEP_SERIES if every else "val_accuracy"
        figures[f"lost_s_every_{every}" if every else "lost_s_at_epoch_ends"] = _lost(
            [t for _, t in flow.points(key)], sent
        )

    flow = Flow(pool, _config(root / "stop", checkpoint_every_steps=EVERY, hang_timeout_s=HANG_TIMEOUT_S))
    sent = _signal_a_worker(flow, signal.SIGSTOP)
    flow.finish()
    commits = [t for _, t in flow.points(STEP_SERIES)]
    gaps = [b - a for a, b in zip(commits, commits[1:], strict=False) if b < sent]
    first_after = min(t for t in commits if t > sent + HANG_TIMEOUT_S / 2)
    figures["sigstop_to_first_resumed_step_s"] = first_after - statistics.median(gaps) - sent

    flow = Flow(pool, _config(root / "term", checkpoint_every_steps=EVERY))
    sent = _signal_a_worker(flow, signal.SIGTERM)
    flow.wait(lambda: any(t > sent for _, t in flow.points(STEP_SERIES)), "the SIGTERM's checkpoint was committed")
    figures["sigterm_to_committed_s"] = min(t for _, t in flow.points(STEP_SERIES) if t > sent) - sent
    flow.finish()
    return figures


def _bare_loop(config: dict[str, Any]) -> None:
    """A bare Ray Train loop of the workload's model and batch: seconds per step, and per checkpoint of the same
    state (model, Adam's state) saved by rank 0 and reported (``ray.train.report``: its barrier, its copy to
    storage), timed around the calls on rank 0."""
    import ray.train
    import ray.train.torch
    import torch

    torch.manual_seed(0)
    features, hidden = int(WORKLOAD["synthetic_features"]), list(WORKLOAD["hidden_sizes"])  # type: ignore[call-overload]
    sizes = [features, *hidden]
    layers: list[torch.nn.Module] = []
    for width_in, width_out in zip(sizes, sizes[1:], strict=False):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.ReLU()]
    head = torch.nn.Linear(sizes[-1], 4)  # the synthetic table's 4 classes
    model = ray.train.torch.prepare_model(torch.nn.Sequential(*layers, head))
    optimizer = torch.optim.Adam(model.parameters())
    inputs, labels = torch.randn(64, features), torch.randint(0, 4, (64,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    for _ in range(20):
        step()
    rank, reports = ray.train.get_context().get_world_rank(), config["reports"]
    stepping = reporting = 0.0
    for index in range(reports):
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if rank == 0:
                state = {"model": getattr(model, "module", model).state_dict(), "optimizer": optimizer.state_dict()}
                torch.save(state, f"{folder}/s.pt")
                checkpoint = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"index": index}, checkpoint=checkpoint, checkpoint_dir_name=f"c{index}")
        reporting += time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(EVERY):  # the controller takes each report before the next (its queue holds one)
            step()
        stepping += time.perf_counter() - started
    per_step, per_report = stepping / (reports * EVERY), reporting / reports
    if rank == 0:  # a Result's metrics are its last checkpoint's, so the figures go to a file
        Path(config["out"]).write_text(json.dumps({"per_step": per_step, "per_report": per_report}))


def bare_ray_train_share(root: Path) -> dict[str, float]:
    """The share of checkpoints every EVERY steps in a bare Ray Train loop of the same model: the floor the
    pipeline's figure stands on (Ray's report barrier and copy to storage, on the same 2 cores)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _bare_loop,
        train_loop_config={"reports": 12, "out": str(root / "bare.json")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(root / "bare"), name="bare"),
    )
    trainer.fit()
    measured = json.loads((root / "bare.json").read_text())
    per_step, per_report = measured["per_step"], measured["per_report"]
    return {"bare_s_per_step": per_step, "bare_s_per_report": per_report, "bare_share": per_report / (EVERY * per_step)}


def main() -> None:
    import ray
    from prefect.testing.utilities import prefect_test_harness

    from bench.summary import RESULTS, share_verdict, write_figures
    from raytrain_driver.cluster import worker_env

    with tempfile.TemporaryDirectory(prefix="prt-bench-") as tmp:
        root = Path(tmp)
        os.environ["PREFECT_HOME"] = str(root / "prefect")  # before Prefect reads its settings
        ray.init(address="local", num_cpus=2, runtime_env={"env_vars": worker_env()}, logging_level=logging.ERROR)
        try:
            bare = bare_ray_train_share(root)
            with prefect_test_harness(server_startup_timeout=120), ThreadPoolExecutor(1) as pool:
                figures = measure(pool, root) | bare
        finally:
            ray.shutdown()
    recovery = RESULTS / "recovery.json"
    if recovery.exists():
        figures["fresh_start_s"] = json.loads(recovery.read_text())["fresh_start_s"]
    share = figures["checkpoint_share"]
    print(f"checkpoints every {EVERY} steps ({figures['checkpoints_per_run']} in 3 epochs): {share:.1%} of the epochs'")
    print(f"  time ({figures[f'epochs_s_every_{EVERY}']:.1f} s vs {figures['epochs_s_at_epoch_ends']:.1f} s)")
    print(f"  target <= {SHARE_TARGET:.0%}: {share_verdict(share, SHARE_TARGET)}")
    print(
        f"  a bare Ray Train loop of the same model: {figures['bare_share']:.1%} "
        f"({1000 * figures['bare_s_per_report']:.1f} ms per report, "
        f"{1000 * figures['bare_s_per_step']:.1f} ms per step)"
    )
    print(
        f"work lost to a SIGKILL at a random moment: {figures[f'lost_s_every_{EVERY}']:.1f} s every {EVERY} steps, "
        f"{figures['lost_s_at_epoch_ends']:.1f} s at epoch ends"
    )
    stop = figures["sigstop_to_first_resumed_step_s"]
    bound = HANG_TIMEOUT_S + 1.2 * figures.get("fresh_start_s", float("nan"))
    verdict = "met" if stop <= bound else "missed"
    print(f"SIGSTOP -> first resumed step: {stop:.1f} s (target <= {bound:.1f} s: {verdict})")
    print(f"SIGTERM to a worker -> its checkpoint committed: {figures['sigterm_to_committed_s']:.2f} s")
    print(f"written: {write_figures('long_runs', figures)}")


if __name__ == "__main__":
    main()
