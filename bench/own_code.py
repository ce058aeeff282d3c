"""What the pipeline costs your own code: prints a table, writes bench/results/own_code.{json,md}.

    python -m bench.own_code            # about 15 minutes on 2 cores (part 3 alone about 9)
    python -m bench.own_code --smoke    # tiny sizes, one repetition

1. The same Ray Train ``train_func`` (bench/own_code_func.py, the seed's shape) under a bare
   ``TorchTrainer.fit()`` and through the flow (``prefect-raytrain train --train-code ...``); time inside the
   loop per epoch (the function reports it), median over epochs and repetitions; goal: flow/bare <= 1.03.
2. Checkpoints written by every rank: FSDP2 on 2 workers, each epoch's checkpoint saved with
   torch.distributed.checkpoint by both ranks, beside the same model gathered into a full state dict and saved
   by rank 0; checkpoint time (save + report) as a share of epoch time.
3. The table classifier (raytrain_tasks/table_classifier/, the default train_code) through the CLI on a
   100,000-row synthetic table with each data loader: ``torch`` (every worker reads the split, a
   DistributedSampler shards it) and ``ray_data`` (the splits kept in the object store, divided among the
   workers on the driver): seconds per epoch (training and scoring); goal: ray_data/torch <= 1.11 (>= 0.9x the
   torch loader's speed).

    python -m bench.own_code --only classifier   # part 3 alone; the other figures in own_code.json are kept
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results")
REPO = Path(__file__).resolve().parents[1]
CODE = "bench.own_code_func:training"


def bare_fit(config: dict[str, Any], func: Any, storage: Path) -> list[dict[str, Any]]:
    """``func`` under a plain TorchTrainer on a local Ray: every report's metrics."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=2, logging_level=logging.ERROR, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        trainer = TorchTrainer(
            func,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(name="bare", storage_path=str(storage)),
        )
        result = trainer.fit()
        frame = result.metrics_dataframe
        assert frame is not None, "the function reported no checkpoint"
        return [dict(row) for _, row in frame.iterrows()]
    finally:
        ray.shutdown()


def flow_fit(config: dict[str, Any], workdir: Path) -> list[float]:
    """The same function through ``prefect-raytrain train``: its per-epoch in-loop seconds from MLflow."""
    from mlflow import MlflowClient

    command = [str(Path(sys.executable).with_name("prefect-raytrain")), "train", "--train-code", CODE]
    command += ["--epochs", str(config["epochs"]), "--batch-size", str(config["batch_size"]), "--no-register"]
    command += ["--train-config", json.dumps({"rows": config["rows"]}), "--experiment-name", "bench-own-code"]
    env = {**os.environ, "PREFECT_HOME": str(workdir / ".prefect")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    client = MlflowClient(f"sqlite:///{REPO / '.pipeline' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("bench-own-code")
    assert experiment is not None
    run = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]
    return [m.value for m in client.get_metric_history(run.info.run_id, "loop_seconds")]


def classifier_epoch_seconds(rows: int, epochs: int, workdir: Path, loader: str) -> list[float]:
    """The table classifier on a synthetic table, fed by ``loader``, through ``prefect-raytrain train``: each
    epoch's seconds (training and scoring, as it logs ``epoch_seconds``)."""
    from mlflow import MlflowClient

    experiment = f"bench-classifier-{loader}"
    command = [str(Path(sys.executable).with_name("prefect-raytrain")), "train", "--epochs", str(epochs)]
    command += ["--no-register", "--experiment-name", experiment, "--batch-size", "64"]
    settings = {"dataset": "synthetic", "synthetic_samples": rows, "data_loader": loader}
    command += ["--train-code", "raytrain_tasks.table_classifier:classifier", "--train-config", json.dumps(settings)]
    env = {**os.environ, "PREFECT_HOME": str(workdir / ".prefect")}
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    client = MlflowClient(f"sqlite:///{workdir / '.pipeline' / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    run = client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]
    return [m.value for m in client.get_metric_history(run.info.run_id, "epoch_seconds")]


LOADERS = ("torch", "ray_data")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--only", choices=["classifier"], help="one part; the other figures on file are kept")
    args = parser.parse_args(argv)
    reps = 1 if args.smoke else 2
    figures: dict[str, Any] = {}
    if args.only is None:
        figures |= _own_code_figures(args.smoke, reps)
    figures |= _classifier_figures(args.smoke, reps)
    RESULTS.mkdir(exist_ok=True)
    on_file = RESULTS / "own_code.json"
    if args.only is not None and on_file.exists():
        kept = json.loads(on_file.read_text())
        if kept.get("smoke") == args.smoke:  # never smoke-sized figures beside real ones under one flag
            figures = {**kept, **figures}
    on_file.write_text(json.dumps({**figures, "smoke": args.smoke}, indent=1))
    table = render(figures)
    (RESULTS / "own_code.md").write_text(f"# Own code ({time.strftime('%Y-%m-%d %H:%M')})\n\n{table}\n")
    print(table)


def _own_code_figures(smoke: bool, reps: int) -> dict[str, float]:
    """Parts 1 and 2: level b bare vs through the flow, and FSDP2's checkpoint share."""
    from bench.own_code_func import sharded_func, train_func

    config = {"epochs": 3 if smoke else 5, "batch_size": 128, "lr": 3e-3, "seed": 0}
    config["rows"] = 4_000 if smoke else 60_000
    bare, flow = [], []
    with tempfile.TemporaryDirectory(prefix="bench-own-code-") as tmp:
        for rep in range(reps):  # contenders alternate
            reports = bare_fit({**config, "num_workers": 2, "use_gpu": False}, train_func, Path(tmp) / f"bare{rep}")
            bare += [float(r["loop_seconds"]) for r in reports]
            flow += flow_fit(config, Path(tmp))
        sharded: dict[str, list[float]] = {}
        for mode in ("dcp", "full"):
            reports = bare_fit({**config, "mode": mode, "hidden": 256}, sharded_func, Path(tmp) / f"fsdp-{mode}")
            timed = [r for r in reports if not math.isnan(float(r.get("epoch_seconds", math.nan)))]
            sharded[mode] = [float(r["checkpoint_seconds"]) / float(r["epoch_seconds"]) for r in timed]
    return {
        "in_loop_bare_s": statistics.median(bare),
        "in_loop_flow_s": statistics.median(flow),
        "in_loop_ratio": statistics.median(flow) / statistics.median(bare),
        "checkpoint_share_every_rank_dcp": statistics.median(sharded["dcp"]),
        "checkpoint_share_rank0_full_state_dict": statistics.median(sharded["full"]),
    }


def _classifier_figures(smoke: bool, reps: int) -> dict[str, float]:
    """Part 3: the table classifier, seconds per epoch with each loader (alternating)."""
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-classifier-") as tmp:
        for rep in range(reps):
            workdir = Path(tmp) / f"classifier-{rep}"
            workdir.mkdir()
            for loader in LOADERS:
                rows = 20_000 if smoke else 100_000
                seconds.setdefault(loader, []).extend(classifier_epoch_seconds(rows, 3, workdir, loader))
    figures = {f"classifier_{loader}_epoch_s": statistics.median(seconds[loader]) for loader in LOADERS}
    figures["classifier_ray_data_ratio"] = figures["classifier_ray_data_epoch_s"] / figures["classifier_torch_epoch_s"]
    return figures


def render(figures: dict[str, Any]) -> str:
    rows = ["| figure | value |", "|---|---|"]
    if "in_loop_ratio" in figures:
        rows += [
            f"| level b, seconds in the loop per epoch, bare TorchTrainer.fit() | {figures['in_loop_bare_s']:.3f} |",
            f"| level b, the same through the flow | {figures['in_loop_flow_s']:.3f} |",
            f"| level b in-loop ratio flow/bare (goal <= 1.03) | {figures['in_loop_ratio']:.3f} |",
            f"| FSDP2, checkpoint share of epoch, every rank writes (DCP) | "
            f"{figures['checkpoint_share_every_rank_dcp']:.1%} |",
            f"| FSDP2, checkpoint share of epoch, full state dict from rank 0 | "
            f"{figures['checkpoint_share_rank0_full_state_dict']:.1%} |",
        ]
    if "classifier_ray_data_ratio" in figures:
        rows += [
            f"| table classifier, seconds per epoch (synthetic table), data_loader {loader} | "
            f"{figures[f'classifier_{loader}_epoch_s']:.3f} |"
            for loader in LOADERS
        ]
        rows.append(
            f"| table classifier, ray_data/torch seconds per epoch (goal <= 1.11) | "
            f"{figures['classifier_ray_data_ratio']:.3f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
