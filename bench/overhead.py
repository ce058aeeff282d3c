"""What the orchestration costs, side by side: prints a table, writes bench/results/overhead.{json,md}.

    python -m bench.overhead            # full (about 12 minutes on 2 cores)
    python -m bench.overhead --smoke    # one repetition, tiny sizes (CI, so it never rots)
    python -m bench.overhead --workers 8 --use-gpu   # a bigger machine or a GPU node: NCCL, one GPU per worker

1. In-loop parity: the same epoch loop, model and data at world size 2, under plain torch.distributed (gloo,
   torch.multiprocessing) and under Ray Train (prepare_model / prepare_data_loader). Time inside the loop.
2. Scaling: samples/s of the Ray Train contender with 1 and 2 workers.
3. Orchestration: the whole flow (CLI: prepare + fit + register + MLflow, temporary Prefect API) against a bare
   TorchTrainer.fit() of the same job; fixed cost = wall - time in the training loop; a breakdown from the
   flow's log timestamps, and the peak memory (PSS) of each process tree. The flow runs repeat in one
   directory (steady state); the first run there, which creates the databases, is reported on its own.
Contenders alternate within each repetition; medians are reported. The table classifier's two data loaders are
compared by bench.own_code (part 3).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results")


@dataclass(frozen=True)
class Workload:
    rows: int
    features: int
    classes: int
    hidden: tuple[int, ...]
    batch_size: int
    epochs: int
    seed: int = 0
    use_gpu: bool = False


FULL = Workload(rows=120_000, features=64, classes=10, hidden=(256, 256), batch_size=128, epochs=2)
SMOKE = Workload(rows=4_000, features=16, classes=4, hidden=(32,), batch_size=64, epochs=1)


# --- the shared training loop -------------------------------------------------------------------------------
def make_data(w: Workload) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(w.seed)
    centers = rng.normal(0, 2, size=(w.classes, w.features)).astype(np.float32)
    y = rng.integers(0, w.classes, size=w.rows)
    x = (centers[y] + rng.normal(0, 1, size=(w.rows, w.features))).astype(np.float32)
    return x, y.astype(np.int64)


def epoch_loop(model: Any, loader: Any, sampler: Any, w: Workload, device: Any) -> list[float]:
    """The loop both contenders run: seconds per epoch (on GPU, synchronised before the clock stops)."""
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    seconds = []
    for epoch in range(w.epochs):
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        for features, labels in loader:
            features, labels = features.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(features), labels).backward()
            optimizer.step()
        if w.use_gpu:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds


def _loader(w: Workload, rank: int, world: int) -> tuple[Any, Any]:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    x, y = make_data(w)
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    sampler: Any = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=w.seed, drop_last=True)
    return DataLoader(data, batch_size=w.batch_size, sampler=sampler, pin_memory=w.use_gpu), sampler


def _model(w: Workload) -> Any:
    import torch

    from raytrain_tasks.table_classifier.models import build_mlp

    torch.manual_seed(w.seed)
    return build_mlp(w.features, w.classes, w.hidden)


# --- contender (a): plain torch.distributed ----------------------------------------------------------------
def _plain_worker(rank: int, world: int, port: int, w: Workload, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)  # what torchrun sets (OMP_NUM_THREADS=1) and what our workers use
    dist.init_process_group("nccl" if w.use_gpu else "gloo", rank=rank, world_size=world)
    loader, sampler = _loader(w, rank, world)
    if w.use_gpu:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        model = DistributedDataParallel(_model(w).to(device), device_ids=[rank])
    else:
        device = torch.device("cpu")
        model = DistributedDataParallel(_model(w))
    seconds = epoch_loop(model, loader, sampler, w, device)
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


PLAIN_ATTEMPTS = 3
PLAIN_RETRIES: list[str] = []  # why a plain contender was run again (reported with the results)


def run_plain(w: Workload, world: int, tmp: Path) -> dict[str, float]:
    """The plain DDP contender; run again (new port, new processes) if its processes die.

    Seen once in about ten `make bench` runs here: both gloo processes aborted ("terminate called without an
    active exception", SIGABRT) with no Python error. The figures of a run that died are discarded, never used.
    """
    import torch.multiprocessing as mp

    for attempt in range(1, PLAIN_ATTEMPTS + 1):
        out = tmp / f"plain-{time.monotonic_ns()}.json"
        started = time.perf_counter()
        try:
            mp.start_processes(
                _plain_worker, args=(world, _free_port(), w, str(out)), nprocs=world, start_method="spawn"
            )
        except mp.ProcessExitedException as exc:
            PLAIN_RETRIES.append(str(exc))
            print(f"  plain DDP contender died ({exc}); attempt {attempt} of {PLAIN_ATTEMPTS}", flush=True)
            if attempt == PLAIN_ATTEMPTS:
                raise
            continue
        wall = time.perf_counter() - started
        return _figures(json.loads(out.read_text()), wall, w, world)
    raise AssertionError("unreachable")


# --- contender (b): Ray Train --------------------------------------------------------------------------------
def _ray_loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch

    w = Workload(**{**config["workload"], "hidden": tuple(config["workload"]["hidden"])})
    context = ray.train.get_context()
    torch.set_num_threads(1)
    loader, sampler = _loader(w, context.get_world_rank(), context.get_world_size())
    loader = ray.train.torch.prepare_data_loader(loader)
    model = ray.train.torch.prepare_model(_model(w))
    seconds = epoch_loop(model, loader, sampler, w, ray.train.torch.get_device())
    if context.get_world_rank() == 0:
        Path(config["out"]).write_text(json.dumps(seconds))
    ray.train.report({"done": 1})


def run_ray(w: Workload, world: int, tmp: Path) -> dict[str, float]:
    import ray.train
    from ray.train.torch import TorchTrainer

    out = tmp / f"ray-{time.monotonic_ns()}.json"
    started = time.perf_counter()
    TorchTrainer(
        _ray_loop,
        train_loop_config={"workload": asdict(w), "out": str(out)},
        scaling_config=ray.train.ScalingConfig(num_workers=world, use_gpu=w.use_gpu),
        run_config=ray.train.RunConfig(name=out.stem, storage_path=str(tmp / "ray")),
    ).fit()
    wall = time.perf_counter() - started
    return _figures(json.loads(out.read_text()), wall, w, world)


def _figures(seconds: list[float], wall: float, w: Workload, world: int) -> dict[str, float]:
    in_loop = sum(seconds)
    trained = (w.rows // world) * world * w.epochs
    return {"in_loop_s": in_loop, "samples_per_s": trained / in_loop, "wall_s": wall}


# --- orchestration: the whole flow vs a bare fit ------------------------------------------------------------
# The flow's job (and the bare fit's, on the dataset the flow prepared): epochs of a few seconds, so the
# checkpoint share is measured against epochs shorter than most real ones (a pessimistic figure).
FLOW_BATCH_SIZE = 64
# The default code (the table classifier's TrainSpec), whose train_func the bare contender fits under a plain
# TorchTrainer: the same job on both sides.
FLOW_JOB = [
    "--train-config",
    '{"dataset": "synthetic", "synthetic_samples": 24000}',
    "--batch-size",
    str(FLOW_BATCH_SIZE),
]
LOG_TIME = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \| \w+\s*\| (.*)$")


def run_flow(workdir: Path, epochs: int) -> dict[str, float]:
    """The CLI on embedded defaults in ``workdir``; breakdown from its log timestamps.

    Every run uses the same directory, as `make run` does: the first creates the Prefect and MLflow databases
    (and has no champion to beat); the later ones are the steady state of a scheduled job.
    """
    workdir.mkdir(exist_ok=True)
    env = {**os.environ, "PREFECT_HOME": str(workdir / "prefect")}
    env.pop("PREFECT_API_URL", None)
    # --verbose: the workers' per-epoch lines (the checkpoint figures below) are Ray output, which the default
    # console leaves in Ray's logs.
    command = [sys.executable, "-m", "flows.training", "--epochs", str(epochs), "--experiment-name", "bench"]
    command += [*FLOW_JOB, "--verbose"]
    started_at = datetime.now()
    run = _run_measured(command, workdir, env)
    marks = _log_marks(run.output, started_at)
    in_loop = _mlflow_in_loop(f"sqlite:///{workdir / '.pipeline' / 'mlflow.db'}", "bench")
    figures = {
        "wall_s": run.wall_s,
        "in_loop_s": in_loop,
        "fixed_s": run.wall_s - in_loop,
        "peak_pss_gib": run.peak_pss_gib,
        "peak_rss_gib": run.peak_rss_gib,
    }
    figures.update(marks)
    checkpoints = _checkpoint_figures(run.output)
    if not checkpoints:
        raise RuntimeError(f"no worker epoch lines in the flow's output:\n{run.output[-3000:]}")
    figures.update(checkpoints)
    if "fit_s" in marks:
        figures["fit_outside_loop_s"] = marks["fit_s"] - in_loop
    return figures


def prepared_files(storage: Path) -> Path:
    """The files of the data version the flow runs prepared (the table classifier's prepare wrote them)."""
    found = next(storage.glob("datasets/*/files/dataset.json"), None)
    if found is None:
        raise SystemExit(f"no data version the default code prepared under {storage}/datasets: run the flow first")
    return found.parent


def run_bare(tmp: Path, epochs: int, data_dir: Path | None = None) -> dict[str, float]:
    """The bare contender in a fresh process, on the files in ``data_dir`` (default: what the flow runs prepared)."""
    workdir = tmp / f"bare-{time.monotonic_ns()}"
    workdir.mkdir()
    # The dataset version the flow runs prepared: the bare contender trains on the same files.
    data_dir = data_dir or prepared_files(tmp / "flow" / ".pipeline" / "storage")
    command = [sys.executable, "-m", "bench.overhead", "--bare-fit", str(workdir), "--epochs", str(epochs)]
    command += ["--dataset", str(data_dir)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = _run_measured(command, workdir, env)
    in_loop = float(re.findall(r"IN_LOOP ([0-9.]+)", run.output)[-1])
    ray_start = float(re.findall(r"RAY_START ([0-9.]+)", run.output)[-1])
    return {
        "wall_s": run.wall_s,
        "in_loop_s": in_loop,
        "fixed_s": run.wall_s - in_loop,
        "peak_pss_gib": run.peak_pss_gib,
        "peak_rss_gib": run.peak_rss_gib,
        "ray_start_s": ray_start,
        **_checkpoint_figures(run.output),
    }


def bare_fit(workdir: Path, epochs: int, data_dir: Path) -> None:
    """Child process: ray.init + a plain ``TorchTrainer(train_func).fit()`` of the default code's train_func (the
    table classifier's spec loop) on the files the flow prepared, with the config the flow gives it; no Prefect,
    no MLflow, none of the pipeline's callbacks."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from flows.cli import parse_config
    from raytrain_driver.cluster import worker_env
    from raytrain_driver.sizing import alive_node_resources, sized_for_cluster
    from raytrain_tasks.user_code import bind, resolve, user_config

    # The flow's own reading of the same flags (run_flow's command), so the two train one job.
    flags = [*FLOW_JOB, "--epochs", str(epochs), "--storage-path", str(workdir / "storage")]
    config = parse_config(flags)
    spec = bind(resolve(config.train_code), config)
    started = time.perf_counter()
    ray.init(address="local", runtime_env={"env_vars": worker_env()}, logging_level=logging.ERROR)
    print(f"RAY_START {time.perf_counter() - started:.3f}")
    # The flow sizes cpus_per_worker to the cluster the same way.
    plan = sized_for_cluster(config, alive_node_resources(), streams=False)
    trainer = TorchTrainer(
        spec.train_func,
        train_loop_config=user_config(config, spec, data_dir),
        scaling_config=ray.train.ScalingConfig(
            num_workers=plan.min_workers, resources_per_worker={"CPU": plan.cpus_per_worker}
        ),
        run_config=ray.train.RunConfig(name="bare", storage_path=config.storage_path),
    )
    result = trainer.fit()
    if result.checkpoint is None or result.metrics_dataframe is None:
        raise SystemExit("the bare fit reported no checkpoint")
    print(f"IN_LOOP {float(result.metrics_dataframe['epoch_seconds'].sum()):.4f}")
    ray.shutdown()


@dataclass
class Measured:
    wall_s: float
    peak_pss_gib: float  # physical memory of the tree: each shared page split between the processes using it
    peak_rss_gib: float  # sum of RSS: counts torch's and Ray's shared libraries once per process
    output: str


def _run_measured(command: list[str], cwd: Path, env: dict[str, str]) -> Measured:
    """Wall seconds, peak memory of the whole process tree (sampled every 0.5 s), and the output.

    Reading PSS (/proc/<pid>/smaps_rollup) of ~20 processes costs ~35 ms of CPU: sampled more often, the
    sampler itself would slow the run it measures on a 2-core machine.
    """
    import psutil

    log = cwd / "output.log"
    started = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        peak_pss = peak_rss = 0
        root = psutil.Process(process.pid)
        seen: dict[int, psutil.Process] = {}
        while process.poll() is None:
            try:
                for child in [root, *root.children(recursive=True)]:
                    seen.setdefault(child.pid, child)
            except psutil.Error:
                pass
            pss = rss = 0
            for member in list(seen.values()):
                try:
                    info = member.memory_full_info()
                except psutil.Error:
                    seen.pop(member.pid, None)
                    continue
                pss += getattr(info, "pss", info.rss)
                rss += info.rss
            peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
            time.sleep(0.5)
    wall = time.perf_counter() - started
    output = log.read_text()
    if process.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{output[-3000:]}")
    return Measured(wall, peak_pss / 2**30, peak_rss / 2**30, output)


# A TrainSpec's epoch line: "(0.52 s, ...; checkpoint 0.031 s)". The space before "s" is optional so that results
# kept from runs of other releases parse too.
CHECKPOINT_LINE = re.compile(r"epoch \d+/\d+ .*\(([0-9.]+) ?s, [0-9]+ samples/s; checkpoint ([0-9.]+) ?s\)")


def _checkpoint_figures(output: str) -> dict[str, float]:
    """From the workers' per-epoch lines: seconds at the epoch boundary (save, upload, report) vs in the epoch."""
    pairs = [(float(a), float(b)) for a, b in CHECKPOINT_LINE.findall(output)]
    if not pairs:
        return {}
    epoch_s, checkpoint_s = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    return {
        "checkpoint_s_per_epoch": checkpoint_s / len(pairs),
        "checkpoint_share": checkpoint_s / (epoch_s + checkpoint_s),
    }


def _log_marks(output: str, started_at: datetime) -> dict[str, float]:
    """Seconds of each stage, from Prefect's log timestamps (HH:MM:SS.mmm) relative to the process start."""
    events: list[tuple[float, str]] = []
    for line in output.splitlines():
        match = LOG_TIME.match(line.strip())
        if match:
            stamp = datetime.combine(started_at.date(), datetime.strptime(match.group(1), "%H:%M:%S.%f").time())
            events.append(((stamp - started_at).total_seconds(), match.group(2)))

    def first(pattern: str) -> float | None:
        return next((t for t, text in events if re.search(pattern, text)), None)

    begin = first(r"Beginning flow run")
    prepared = first(r"Task run 'prepare-data.*Finished")
    fitted = first(r"Task run 'fit-.*Finished")
    registered = first(r"Task run 'register-.*Finished")
    done = first(r"Flow run .* Finished")
    marks: dict[str, float] = {}
    if begin is not None:
        marks["start_to_flow_s"] = begin  # imports, the temporary Prefect API and the local Ray
    if None not in (begin, prepared, fitted, registered, done):
        marks["prepare_s"] = prepared - begin  # type: ignore[operator]
        marks["fit_s"] = fitted - prepared  # type: ignore[operator]
        marks["register_s"] = registered - fitted  # type: ignore[operator]
        marks["flow_end_s"] = done  # type: ignore[assignment]
    return {k: v for k, v in marks.items() if v is not None}


IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| ( *)(\S+)$")


def import_seconds(module: str = "flows.training", repetitions: int = 3) -> dict[str, float]:
    """``python -X importtime -c "import <module>"`` in fresh processes: the median cumulative seconds of the
    module and of each package it imports directly (what the CLI pays before it can start anything)."""
    runs: list[dict[str, float]] = []
    for _ in range(repetitions):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", f"import {module}"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            check=True,
        )
        seconds: dict[str, float] = {}
        children: dict[str, float] = {}  # importtime prints what a module imports before the module itself
        for line in done.stderr.splitlines():
            match = IMPORT_LINE.match(line)
            if not match:
                continue
            if not match[2]:  # a top-level import: the module itself, or one of Python's start-up (site, ...)
                if match[3] == module:
                    seconds = {**children, module: int(match[1]) / 1e6}
                children = {}
            elif len(match[2]) == 2:
                name = match[3].split(".")[0]
                children[name] = children.get(name, 0.0) + int(match[1]) / 1e6
        runs.append(seconds)
    return median_of(runs)


def _mlflow_in_loop(tracking_uri: str, experiment: str) -> float:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise SystemExit(f"no MLflow experiment {experiment!r} at {tracking_uri}")
    experiment_id = found.experiment_id
    (run,) = client.search_runs([experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    return sum(m.value for m in client.get_metric_history(run.info.run_id, "epoch_seconds"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = set.intersection(*(set(r) for r in runs))
    return {k: statistics.median(r[k] for r in runs) for k in sorted(keys)}


def machine() -> dict[str, str]:
    import ray
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "device": "GPU " + gpu if gpu != "none" else "CPU",
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one repetition, tiny sizes")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="world size of the parity runs (default 2)")
    parser.add_argument("--use-gpu", action="store_true", help="NCCL and one GPU per worker in both contenders")
    parser.add_argument("--bare-fit", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--parity-only",
        action="store_true",
        help="only the in-loop parity and scaling rows (a short GPU lease); written to overhead-parity.{json,md}",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dataset", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_fit:
        bare_fit(args.bare_fit, args.epochs, args.dataset)
        return
    workload, reps = (SMOKE, 1) if args.smoke else (FULL, args.repetitions)
    workload = Workload(**{**asdict(workload), "use_gpu": args.use_gpu})
    world = args.workers
    flow_epochs = 1 if args.smoke else 3

    import ray

    from raytrain_driver.cluster import worker_env

    results: dict[str, Any] = {"machine": machine(), "workload": asdict(workload), "repetitions": reps}
    print("machine:", ", ".join(f"{k}={v}" for k, v in results["machine"].items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="prt-bench-") as tmp_name:
        tmp = Path(tmp_name)
        plain, ray_2, ray_1 = [], [], []
        ray.init(address="local", runtime_env={"env_vars": worker_env()}, logging_level=logging.ERROR)
        try:
            for rep in range(reps):
                plain.append(run_plain(workload, world, tmp))
                ray_2.append(run_ray(workload, world, tmp))
                # --smoke keeps the code paths running, not the figures: the 1-worker row is the same code.
                ray_1.append(ray_2[-1] if args.smoke else run_ray(workload, 1, tmp))
                print(
                    f"  parity rep {rep + 1}/{reps}: plain {plain[-1]['in_loop_s']:.2f} s, "
                    f"ray {ray_2[-1]['in_loop_s']:.2f} s in the loop",
                    flush=True,
                )
            results["parity"] = {"plain_ddp": median_of(plain), "ray_train": median_of(ray_2)}
            results["plain_ddp_retries"] = PLAIN_RETRIES
            results["scaling"] = {"1_worker": median_of(ray_1), f"{world}_workers": median_of(ray_2)}
            results["world_size"] = world
            if args.parity_only:
                write_parity(results)
                return
        finally:
            ray.shutdown()
        first_run = run_flow(tmp / "flow", flow_epochs)
        print(f"  first flow run (fresh Prefect and MLflow databases): {first_run['wall_s']:.1f} s", flush=True)
        flows, bares = [], []
        for rep in range(reps):
            # --smoke keeps the code paths running, not the figures: its first flow run stands for the steady state.
            flows.append(first_run if args.smoke else run_flow(tmp / "flow", flow_epochs))
            bares.append(run_bare(tmp, flow_epochs))
            print(
                f"  orchestration rep {rep + 1}/{reps}: flow {flows[-1]['wall_s']:.1f} s, "
                f"bare fit {bares[-1]['wall_s']:.1f} s",
                flush=True,
            )
        results["orchestration"] = {"flow": median_of(flows), "bare_fit": median_of(bares), "first_flow": first_run}
        results["imports"] = import_seconds(repetitions=reps)
        results["flow_epochs"] = flow_epochs

    markdown = render(results)
    print(markdown)
    RESULTS.mkdir(exist_ok=True)
    name = "overhead-smoke" if args.smoke else "overhead"
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1))
    (RESULTS / f"{name}.md").write_text(markdown)
    print(f"written: {RESULTS / name}.json, .md")


def write_parity(r: dict[str, Any]) -> None:
    """The parity and scaling rows alone (``--parity-only``)."""
    plain, rt, n = r["parity"]["plain_ddp"], r["parity"]["ray_train"], r["world_size"]
    one = r["scaling"]["1_worker"]
    markdown = "\n".join(
        [
            f"Machine: {', '.join(f'{k} {v}' for k, v in r['machine'].items())}. Medians of {r['repetitions']}.",
            "",
            "| benchmark | contender A | contender B | B / A | target |",
            "|---|---|---|---|---|",
            f"| in-loop time, {n} workers | plain DDP {plain['in_loop_s']:.2f} s | Ray Train {rt['in_loop_s']:.2f} s "
            f"| {rt['in_loop_s'] / plain['in_loop_s']:.3f}x | <= 1.03x |",
            f"| samples/s, 1 worker | plain DDP ({n} workers) {plain['samples_per_s']:.0f} "
            f"| Ray Train {one['samples_per_s']:.0f} | {one['samples_per_s'] / plain['samples_per_s']:.3f}x | |",
            "",
        ]
    )
    print(markdown)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "overhead-parity.json").write_text(json.dumps(r, indent=1))
    (RESULTS / "overhead-parity.md").write_text(markdown)
    print(f"written: {RESULTS / 'overhead-parity'}.json, .md")


def render(r: dict[str, Any]) -> str:
    p, s, o = r["parity"], r["scaling"], r["orchestration"]
    n = r["world_size"]
    plain, rt = p["plain_ddp"], p["ray_train"]
    flow, bare = o["flow"], o["bare_fit"]
    w = r["workload"]
    lines = [
        f"Machine: {', '.join(f'{k} {v}' for k, v in r['machine'].items())}. Medians of {r['repetitions']}.",
        f"Workload: {w['rows']} rows x {w['features']} features, MLP {w['hidden']}, batch {w['batch_size']}, "
        f"{w['epochs']} epochs.",
        "",
        "| benchmark | contender A | contender B | B / A | target |",
        "|---|---|---|---|---|",
        f"| in-loop time, {n} workers | plain DDP {plain['in_loop_s']:.2f} s | Ray Train {rt['in_loop_s']:.2f} s "
        f"| {rt['in_loop_s'] / plain['in_loop_s']:.3f}x | <= 1.03x |",
        f"| samples/s, {n} workers | plain DDP {plain['samples_per_s']:.0f} | Ray Train {rt['samples_per_s']:.0f} "
        f"| {rt['samples_per_s'] / plain['samples_per_s']:.3f}x | |",
        f"| wall incl. start-up | plain DDP {plain['wall_s']:.1f} s | Ray Train fit {rt['wall_s']:.1f} s "
        f"| {rt['wall_s'] / plain['wall_s']:.2f}x | |",
        f"| scaling (Ray Train samples/s) | 1 worker {s['1_worker']['samples_per_s']:.0f} "
        f"| {n} workers {s[f'{n}_workers']['samples_per_s']:.0f} "
        f"| {s[f'{n}_workers']['samples_per_s'] / s['1_worker']['samples_per_s']:.2f}x | |",
        f"| fixed cost (wall - in-loop) | bare fit {bare['fixed_s']:.1f} s "
        f"| whole flow, repeat run {flow['fixed_s']:.1f} s "
        f"| {flow['fixed_s'] / bare['fixed_s']:.2f}x | <= 1.3x |",
        f"| peak memory of the process tree, PSS | bare fit {bare['peak_pss_gib']:.2f} GiB "
        f"| whole flow {flow['peak_pss_gib']:.2f} GiB | | flow <= 3 GiB |",
        f"| peak memory, sum of RSS (shared pages counted per process) | bare fit {bare['peak_rss_gib']:.2f} GiB "
        f"| whole flow {flow['peak_rss_gib']:.2f} GiB | | |",
        "",
        "Whole flow, where the fixed seconds go (from its log timestamps): "
        + ", ".join(
            f"{label} {flow[key]:.1f} s"
            for label, key in [
                (
                    "start-up to flow begin (imports, temporary Prefect API and local Ray, side by side)",
                    "start_to_flow_s",
                ),
                ("prepare-data", "prepare_s"),
                ("fit outside the loop (worker group, MLflow run, evaluation)", "fit_outside_loop_s"),
                ("register-model", "register_s"),
            ]
            if key in flow
        )
        + (f", after the flow (teardown) {flow['wall_s'] - flow['flow_end_s']:.1f} s" if "flow_end_s" in flow else "")
        + f". Bare fit: Ray start {bare['ray_start_s']:.1f} s of {bare['fixed_s']:.1f} s fixed.",
    ]
    imports = r.get("imports")
    if imports:
        parts = sorted(((k, v) for k, v in imports.items() if k != "flows.training"), key=lambda kv: -kv[1])
        lines += [
            "",
            f"Import of `flows.training` before the CLI starts anything (`python -X importtime`): "
            f"{imports.get('flows.training', float('nan')):.2f} s; of it, first-hand: "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts[:6])
            + ".",
        ]
    first = o.get("first_flow")
    if first:
        lines += [
            "",
            f"First flow run in a fresh directory (it creates the Prefect and MLflow databases; no champion to "
            f"compare with): wall {first['wall_s']:.1f} s, fixed {first['fixed_s']:.1f} s "
            f"({first['fixed_s'] / bare['fixed_s']:.2f}x the bare fit's), start-up to flow begin "
            f"{first.get('start_to_flow_s', float('nan')):.1f} s. The repeat runs above reuse that directory, as "
            "`make run` does and as a scheduled deployment does with its Prefect server.",
        ]
    if "checkpoint_share" in flow:
        lines += [
            "",
            f"Checkpointing (local storage, sync upload, {flow['in_loop_s'] / r['flow_epochs']:.1f} s epochs): "
            f"{flow['checkpoint_s_per_epoch']:.3f} s per epoch at the epoch boundary (save, copy, report barrier), "
            f"{100 * flow['checkpoint_share']:.1f}% of epoch time (target <= 3%).",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
