"""Warm served runs next to a bare fit: what a run costs when `make serve` keeps Prefect, Ray and MLflow warm.

    python -m bench.served [--runs 10]

Starts a `prefect server` (its own PREFECT_HOME, a free 127.0.0.1 port) and `python -m deployments.serve` in a
copy of the project, as a user's checkout; serve keeps one local Ray warm for its runs. Then triggers the ad-hoc
deployment RUNS times, one after the other, with the overhead benchmark's flow job (same dataset, epochs and
batch size), as the UI's custom run or `prefect deployment run` would:

- fixed cost of a served run = (Completed - created, the Prefect API's timestamps) - its in-loop time (the
  sum of its epochs' `epoch_seconds` in MLflow): polling, the flow-run process, Ray connect, prepare, the
  worker group, MLflow, register. Run 1 (a new dataset version, a new MLflow experiment and model) is reported
  on its own; the figure is the median of the later runs.
- the bare contender, as in bench.overhead: a fresh process doing ray.init + TorchTrainer.fit() of the same
  train loop on the same dataset files, fixed cost = wall - in-loop; run BARE_FITS times once serve and the
  server have stopped (nothing idles beside it). `make bench` passes `--bare-from bench/results/overhead.json`:
  the median of the bare fits bench.overhead ran minutes before, on the same job, instead of running more.
- leaks: after run 1 and after the last run, the actors not dead and the placement groups not removed on the
  warm Ray (State API, with its address), and the memory (PSS) of serve's processes (serve and its Ray).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.overhead import FLOW_BATCH_SIZE, _free_port, machine, prepared_files, run_bare
from bench.summary import write_figures

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EPOCHS = 3  # bench.overhead's flow_epochs: the same job as its whole-flow and bare-fit contenders
BARE_FITS = 2
JOB = {
    "train_config": {"dataset": "synthetic", "synthetic_samples": 24000},
    "batch_size": FLOW_BATCH_SIZE,
    "epochs": EPOCHS,
    "num_workers": 2,
    "experiment_name": "bench-served",
    "model_name": "bench-served",
}


def _start(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as sink:
        return subprocess.Popen(
            command, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """SIGTERM to the process, then its whole process group (everything it started) once it exited or lingered."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=timeout)


def _wait_for(condition: Any, what: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:g} s\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def pss_gib(root: int) -> float:
    """Memory of ``root`` and every process under it, each shared page split between its users."""
    import psutil

    total = 0
    process = psutil.Process(root)
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_full_info().pss
        except psutil.Error:  # ended between the listing and the look
            continue
    return total / 2**30


def pss_by_name(root: int) -> dict[str, float]:
    """MiB of PSS per process name under ``root`` (where the memory of a warm Ray goes)."""
    import psutil

    names: dict[str, float] = {}
    process = psutil.Process(root)
    for member in [process, *process.children(recursive=True)]:
        try:
            name, pss = member.name(), member.memory_full_info().pss
        except psutil.Error:
            continue
        names[name] = names.get(name, 0.0) + pss / 2**20
    return {name: round(mib) for name, mib in sorted(names.items(), key=lambda item: -item[1])}


def leftovers(address: str) -> dict[str, Any]:
    """Actors not dead and placement groups not removed on the Ray at ``address``."""
    from ray.util.state import list_actors, list_placement_groups

    actors = list_actors(address=address, filters=[("state", "!=", "DEAD")], limit=10_000)
    groups = list_placement_groups(address=address, filters=[("state", "!=", "REMOVED")], limit=10_000)
    return {"actors": sorted(a.class_name for a in actors), "placement_groups": len(groups)}


def served_run(client: Any, deployment_id: Any, tracking: Any) -> dict[str, float]:
    """Trigger one run and wait for it: its seconds from created to Completed, in the loop, and the rest."""
    created = client.create_flow_run_from_deployment(deployment_id, parameters=JOB)
    deadline = time.monotonic() + 600
    while (run := client.read_flow_run(created.id)).state_type.value not in ("COMPLETED", "FAILED", "CRASHED"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"served run {created.id} still {run.state_name} after 600 s")
        time.sleep(0.25)
    if run.state_type.value != "COMPLETED":
        raise RuntimeError(f"served run {created.id} ended {run.state_name}: {run.state.message}")
    experiment = tracking.get_experiment_by_name(JOB["experiment_name"])
    (mlflow_run,) = tracking.search_runs(
        [experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{run.id}'", max_results=1
    )
    in_loop = sum(m.value for m in tracking.get_metric_history(mlflow_run.info.run_id, "epoch_seconds"))
    total = (run.end_time - run.created).total_seconds()
    return {
        "total_s": total,
        "to_start_s": (run.start_time - run.created).total_seconds(),
        "in_loop_s": in_loop,
        "fixed_s": total - in_loop,
        **stages(client, run),
    }


def stages(client: Any, run: Any) -> dict[str, float]:
    """Where a served run's seconds go, from its task runs' timestamps: each task, and the gaps around them."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    spans = {t.name.split("-")[0]: (t.start_time, t.end_time) for t in tasks if t.start_time and t.end_time}
    if set(spans) != {"prepare", "fit", "register"}:
        return {}
    return {
        "start_to_prepare_s": (spans["prepare"][0] - run.start_time).total_seconds(),
        "prepare_s": (spans["prepare"][1] - spans["prepare"][0]).total_seconds(),
        "fit_s": (spans["fit"][1] - spans["fit"][0]).total_seconds(),
        "register_s": (spans["register"][1] - spans["register"][0]).total_seconds(),
        "register_to_end_s": (run.end_time - spans["register"][1]).total_seconds(),
    }


def bare_contender(overhead: Path | None, root: Path, checkout: Path) -> dict[str, Any]:
    """The bare fit's figures: from bench.overhead's results when given (the same job), else measured here."""
    if overhead is not None:
        import json

        results = json.loads(overhead.read_text())
        if results.get("flow_epochs") != EPOCHS:
            raise SystemExit(f"{overhead} has bare fits of {results.get('flow_epochs')} epochs, not {EPOCHS}")
        return {**results["orchestration"]["bare_fit"], "source": str(overhead)}
    data_dir = prepared_files(checkout / ".pipeline" / "storage")
    bares = []
    for _ in range(BARE_FITS):
        bares.append(run_bare(root, EPOCHS, data_dir))
        print(f"  bare fit: {bares[-1]['wall_s']:.1f} s, fixed {bares[-1]['fixed_s']:.1f} s", flush=True)
    return {key: statistics.median(b[key] for b in bares) for key in ("wall_s", "in_loop_s", "fixed_s")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.served", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--bare-from", type=Path, help="bench.overhead's results: take its bare fits' median")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs of serve and the server)")
    args = parser.parse_args(argv)

    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    os.environ["RAY_AUTH_MODE"] = "token"  # the State API calls: serve's local Ray takes the machine's token
    root = Path(tempfile.mkdtemp(prefix="prt-bench-served-"))
    checkout = root / "checkout"
    for package in ("flows", "tasks", "raytrain_tasks", "deployments"):
        shutil.copytree(REPO / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "home").mkdir()
    url = f"http://127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    env.update({"PREFECT_HOME": str(root / "home"), "PREFECT_API_URL": f"{url}/api"})
    server_log, serve_log = root / "server.log", root / "serve.log"
    port = url.rsplit(":", 1)[1]
    try:
        server = _start(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", port], root, env, server_log
        )
        serve = None
        results: dict[str, Any] = {"machine": machine(), "runs": args.runs, "job": JOB}
        try:
            _wait_for(lambda: _answers(f"{url}/api/health"), "prefect server", server, server_log, 120)
            serve = _start([sys.executable, "-m", "deployments.serve"], checkout, env, serve_log)
            _wait_for(lambda: "being served" in serve_log.read_text(), "deployments.serve", serve, serve_log, 180)
            found = re.search(r"warm local Ray at (\S+)", serve_log.read_text())
            if found is None:
                raise RuntimeError(f"serve announced no warm Ray:\n{serve_log.read_text()[-3000:]}")
            address = found.group(1)
            print(
                f"serve keeps a warm Ray at {address}; PSS of serve and its Ray {pss_gib(serve.pid):.2f} GiB",
                flush=True,
            )
            results["idle_pss_gib"] = pss_gib(serve.pid)
            tracking = MlflowClient(f"sqlite:///{checkout / '.pipeline' / 'mlflow.db'}")
            runs: list[dict[str, float]] = []
            with temporary_settings({PREFECT_API_URL: f"{url}/api"}), get_client(sync_client=True) as client:
                deployment = client.read_deployment_by_name("training-pipeline/ad-hoc")
                for number in range(1, args.runs + 1):
                    runs.append(served_run(client, deployment.id, tracking))
                    print(
                        f"  served run {number}/{args.runs}: {runs[-1]['total_s']:.1f} s created -> Completed "
                        f"(started after {runs[-1]['to_start_s']:.1f} s), fixed {runs[-1]['fixed_s']:.1f} s",
                        flush=True,
                    )
                    if number in (1, args.runs):
                        time.sleep(2)  # the run's driver has gone: what is left on the cluster stays
                        state = {
                            **leftovers(address),
                            "serve_pss_gib": pss_gib(serve.pid),
                            "pss_mib_by_process": pss_by_name(serve.pid),
                        }
                        results[f"after_run_{number}"] = state
                        print(f"  after run {number}: {state}", flush=True)
            results["first_run"] = runs[0]
            later = runs[1:] or runs
            results["served"] = {key: statistics.median(r[key] for r in later if key in r) for key in later[0]}
        finally:
            if serve is not None:
                _stop(serve)
            _stop(server)
        if serve is not None and serve.returncode != 0:
            raise RuntimeError(f"serve exited {serve.returncode}:\n{serve_log.read_text()[-3000:]}")
        results["bare_fit"] = bare_contender(args.bare_from, root, checkout)
    finally:
        if args.keep:
            print(f"kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    served, bare = results["served"], results["bare_fit"]
    first, last = results["after_run_1"], results[f"after_run_{args.runs}"]
    print(
        f"\nfixed cost, warm served run (median of runs 2-{args.runs}) vs bare fit: {served['fixed_s']:.1f} s vs "
        f"{bare['fixed_s']:.1f} s = {served['fixed_s'] / bare['fixed_s']:.2f}x (target <= 1.0x); run 1 "
        f"{results['first_run']['fixed_s']:.1f} s"
    )
    print(
        f"after run 1 / run {args.runs}: actors {first['actors']} / {last['actors']}, placement groups "
        f"{first['placement_groups']} / {last['placement_groups']}, PSS of serve and its Ray "
        f"{first['serve_pss_gib']:.2f} / {last['serve_pss_gib']:.2f} GiB"
    )
    print(
        "where a served run's seconds go (median): "
        + ", ".join(f"{key.removesuffix('_s')} {value:.1f} s" for key, value in served.items())
    )
    print(f"written: {write_figures('served', results)}")


if __name__ == "__main__":
    main()
