"""Every target of the benchmarks and its figure, in one table: bench/results/targets.md.

    python -m bench.summary      # the last step of `make bench`

Reads what each benchmark wrote to bench/results/ (overhead.json, served.json, checkpoint_upload.json,
recovery.json, failfast.json; gpu.json from a lent GPU machine) and bench/results/started (written by
`make bench` when it starts: the wall time of the run).
A target whose benchmark did not run, or cannot run on this machine (GPU), says so instead of a figure.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results")
BENCH_WALL_TARGET_S = 15 * 60


def write_figures(name: str, figures: dict[str, Any]) -> Path:
    """One benchmark's figures, as bench/results/<name>.json."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(figures, indent=1))
    return path


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


Row = tuple[str, str, str, str]  # target, figure, verdict, where it comes from


def _ratio_row(target: str, value: float, limit: float, at_most: bool, detail: str, source: str) -> Row:
    met = value <= limit if at_most else value >= limit
    return target, f"{value:.2f}x ({detail})", "met" if met else "missed", source


GPU_TARGET = "GPU: in-loop vs plain NCCL DDP <= 1.03x; 1 worker vs a bare single-GPU loop >= 0.97x"


def _long_run_rows(long: dict[str, Any] | None) -> list[Row]:
    """From bench/results/long_runs.json (bench.long_runs)."""
    share_target = "checkpoints every 50 steps: share of the epochs' time <= 3%"
    if long is None:
        return [(share_target, "not measured", "-", "python -m bench.long_runs")]
    share = long["checkpoint_share"]
    stop = long["sigstop_to_first_resumed_step_s"]
    bound = 30 + 1.2 * long.get("fresh_start_s", float("nan"))
    return [
        (
            share_target,
            f"{share:.1%} ({long['epochs_s_every_50']:.1f} s vs {long['epochs_s_at_epoch_ends']:.1f} s, "
            f"{long['checkpoints_per_run']} checkpoints)",
            share_verdict(share, 0.03),
            "bench.long_runs",
        ),
        (
            "the same checkpoints from a bare Ray Train loop of the model: share (figure, the floor under the above)",
            f"{long['bare_share']:.1%} ({1000 * long['bare_s_per_report']:.1f} ms per report, "
            f"{1000 * long['bare_s_per_step']:.1f} ms per step)"
            if "bare_share" in long
            else "not measured",
            "-",
            "bench.long_runs",
        ),
        (
            "work lost to a SIGKILL at a random moment: every 50 steps vs epoch ends (figure)",
            f"{long['lost_s_every_50']:.2f} s vs {long['lost_s_at_epoch_ends']:.2f} s",
            "-",
            "bench.long_runs",
        ),
        (
            "SIGSTOP of a worker -> first resumed step <= hang_timeout_s 30 + 1.2x a fresh group start",
            f"{stop:.1f} s (bound {bound:.1f} s)",
            "met" if stop <= bound else "missed",
            "bench.long_runs",
        ),
        (
            "SIGTERM to a worker -> its checkpoint committed (figure)",
            f"{long['sigterm_to_committed_s']:.2f} s",
            "-",
            "bench.long_runs",
        ),
    ]


def share_verdict(share: float, target: float) -> str:
    """A share measured as the difference of two runs' times: below 0, the runs' own spread exceeded the cost."""
    if share < 0:
        return "not measured: the runs' spread exceeds it"
    return "met" if share <= target else "missed"


def _scoring_row(scoring: dict[str, Any] | None) -> Row:
    """From bench/results/scoring.json (bench.scoring)."""
    target = "scoring 1M rows with 2 actors: rows/s >= 1.5x the same model in one process"
    if scoring is None:
        return target, "not measured", "-", "python -m bench.scoring"
    speedup = scoring["speedup"]
    shown = f"{speedup:.2f}x ({scoring['pipeline_rows_per_s']:.0f} vs {scoring['one_process_rows_per_s']:.0f} rows/s)"
    return target, shown, "met" if speedup >= 1.5 else "missed", "bench.scoring"


def _gpu_row(gpu: dict[str, Any] | None) -> Row:
    """From bench/results/gpu.json, written by hand from a run on a lent GPU machine (this one has none)."""
    if gpu is None:
        return GPU_TARGET, "not measured (no GPU here)", "-", "python -m bench.overhead --use-gpu"
    runs = gpu["parity_in_loop_s"]
    plain, ray = sorted(runs["plain_ddp_nccl"]), sorted(runs["ray_train"])
    ratio = ray[len(ray) // 2] / plain[len(plain) // 2]
    ratios = [r / q for r, q in zip(runs["ray_train"], runs["plain_ddp_nccl"], strict=True)]
    figure = (
        f"{ratio:.2f}x in the loop at 1 worker, medians of {len(ray)} (each rep {min(ratios):.2f}-{max(ratios):.2f}x), "
        f"{gpu['device']}, {gpu['date']}; world size 2 and a bare loop not measured (one GPU)"
    )
    return GPU_TARGET, figure, "met at 1 worker" if ratio <= 1.03 else "missed", "bench/results/gpu.json"


def rows() -> list[Row]:
    out: list[Row] = []
    overhead = _load("overhead")
    if overhead is None:
        out.append(("overhead targets", "not measured", "-", "python -m bench.overhead"))
    else:
        p, o = overhead["parity"], overhead["orchestration"]
        n = overhead["world_size"]
        source = "bench.overhead"
        out += [
            _ratio_row(
                f"in-loop time, Ray Train vs plain DDP, {n} workers <= 1.03x",
                p["ray_train"]["in_loop_s"] / p["plain_ddp"]["in_loop_s"],
                1.03,
                True,
                f"{p['ray_train']['in_loop_s']:.2f} s vs {p['plain_ddp']['in_loop_s']:.2f} s",
                source,
            ),
            _ratio_row(
                "fixed cost, whole flow (repeat run) vs bare TorchTrainer.fit() <= 1.3x",
                o["flow"]["fixed_s"] / o["bare_fit"]["fixed_s"],
                1.3,
                True,
                f"{o['flow']['fixed_s']:.1f} s vs {o['bare_fit']['fixed_s']:.1f} s",
                source,
            ),
            (
                "checkpointing share of epoch time <= 3%",
                f"{100 * o['flow']['checkpoint_share']:.1f}% ({o['flow']['checkpoint_s_per_epoch']:.3f} s per epoch)",
                "met" if o["flow"]["checkpoint_share"] <= 0.03 else "missed",
                source,
            ),
            (
                "peak memory (PSS) of the whole flow's processes <= 3 GiB",
                f"{o['flow']['peak_pss_gib']:.2f} GiB",
                "met" if o["flow"]["peak_pss_gib"] <= 3 else "missed",
                source,
            ),
        ]
    served = _load("served")
    if served is None:
        out.append(
            ("fixed cost of a warm served run vs a bare fit <= 1.0x", "not measured", "-", "python -m bench.served")
        )
    else:
        runs = served["runs"]
        first, last = served["after_run_1"], served[f"after_run_{runs}"]
        out += [
            _ratio_row(
                f"fixed cost, warm served run (trigger -> Completed - in-loop; median of runs 2-{runs}) vs bare "
                "TorchTrainer.fit() <= 1.0x",
                served["served"]["fixed_s"] / served["bare_fit"]["fixed_s"],
                1.0,
                True,
                f"{served['served']['fixed_s']:.1f} s vs {served['bare_fit']['fixed_s']:.1f} s; run 1 "
                f"{served['first_run']['fixed_s']:.1f} s; trigger -> start {served['served']['to_start_s']:.1f} s",
                "bench.served",
            ),
            (
                f"nothing leaks between served runs (after run 1 / run {runs})",
                f"actors alive {len(first['actors'])} / {len(last['actors'])}, placement groups "
                f"{first['placement_groups']} / {last['placement_groups']}, PSS of serve and its Ray "
                f"{first['serve_pss_gib']:.2f} / {last['serve_pss_gib']:.2f} GiB",
                "met"
                if first["actors"] == last["actors"]
                and last["placement_groups"] == 0
                and last["serve_pss_gib"] <= first["serve_pss_gib"] * 1.1
                else "missed",
                "bench.served",
            ),
        ]
    upload = _load("checkpoint_upload")
    if upload is None:
        out.append(
            ("checkpoint upload vs raw boto3 (parity)", "not measured", "-", "python -m bench.checkpoint_upload")
        )
    else:
        # Throughput means something from a megabyte up; below, one request's latency is the whole figure, and
        # it is shown in seconds instead.
        sized = [s for s in upload["sizes"] if s["mb"] >= 1]
        small = [s for s in upload["sizes"] if s["mb"] < 1]
        worst = min(sized, key=lambda s: s["throughput_ratio"])
        out.append(
            _ratio_row(
                "checkpoint upload throughput (1 MB and up), Ray's pyarrow path vs raw boto3 >= 0.9x (parity)",
                worst["throughput_ratio"],
                0.9,
                False,
                "lowest of "
                + ", ".join(f"{s['mb']:.1f} MB {s['throughput_ratio']:.2f}x" for s in sized)
                + "".join(f"; {s['mb']:.2f} MB: {s['pyarrow_s']:.3f} s vs {s['boto3_s']:.3f} s" for s in small),
                "bench.checkpoint_upload",
            )
        )
    recovery = _load("recovery")
    if recovery is None:
        out.append(("recovery vs a fresh worker group start <= 1.2x", "not measured", "-", "python -m bench.recovery"))
    else:
        out.append(
            _ratio_row(
                "recovery (kill -> first resumed step) vs a fresh worker group start <= 1.2x",
                recovery["recovery_s"] / recovery["fresh_start_s"],
                1.2,
                True,
                f"{recovery['recovery_s']:.1f} s vs {recovery['fresh_start_s']:.1f} s",
                "bench.recovery",
            )
        )
    out += _long_run_rows(_load("long_runs"))
    out.append(_scoring_row(_load("scoring")))
    failfast = _load("failfast")
    if failfast is None:
        out.append(("a wrong setting fails before any worker starts", "not measured", "-", "python -m bench.failfast"))
    else:
        cases = failfast["cases"]
        slowest = max(cases, key=lambda c: c["seconds"])
        started = sum(c["actors"] or 0 for c in cases)  # None: no cluster to start any on
        out.append(
            (
                "a wrong setting fails before any Ray Train actor starts",
                f"{len(cases)} settings, {started} actors started; slowest {slowest['seconds']:.1f} s "
                f"({slowest['case']})",
                "met" if started == 0 and all(c["error"] != "" for c in cases) else "missed",
                "bench.failfast",
            )
        )
    own = _load("own_code")
    if own is None or own.get("smoke") or "in_loop_ratio" not in own:
        out.append(("your own train_func: flow/bare in-loop <= 1.03x", "not measured", "-", "python -m bench.own_code"))
    else:
        out.append(
            _ratio_row(
                "your own train_func: flow/bare in-loop <= 1.03x",
                own["in_loop_ratio"],
                1.03,
                True,
                f"{own['in_loop_flow_s']:.3f} s vs {own['in_loop_bare_s']:.3f} s per epoch",
                "bench.own_code",
            )
        )
        out.append(
            (
                "FSDP2 checkpoints written by every rank: share of epoch (figure, beside rank 0's full state dict)",
                f"{own['checkpoint_share_every_rank_dcp']:.1%} vs {own['checkpoint_share_rank0_full_state_dict']:.1%}",
                "-",
                "bench.own_code",
            )
        )
    if own is not None and not own.get("smoke") and "classifier_ray_data_ratio" in own:
        out.append(
            _ratio_row(
                "the table classifier's seconds per epoch, data_loader ray_data vs torch <= 1.11x",
                own["classifier_ray_data_ratio"],
                1.11,
                True,
                f"{own['classifier_ray_data_epoch_s']:.3f} s vs {own['classifier_torch_epoch_s']:.3f} s per epoch",
                "bench.own_code --only classifier",
            )
        )
    waits = _load("waits")
    if waits is None:
        out.append(("unreachable services are named in seconds", "not measured", "-", "python -m bench.waits"))
    else:
        # The epoch logger logs an outage and goes on (no error); every other case must end in one.
        late = [
            r
            for r in waits["rows"]
            if r["seconds"] > waits["targets_s"][r["figure"]] or not (r["error"] or "logger" in r["figure"])
        ]
        slowest = max(waits["rows"], key=lambda r: r["seconds"] / waits["targets_s"][r["figure"]])
        out.append(
            (
                "unreachable or refusing S3/MLflow/Ray named within its target (S3 15 s, MLflow logger 30 s, "
                "Ray 10 s / 30 s)",
                f"{len(waits['rows'])} cases, {len(late)} late or silent; closest: {slowest['case']} "
                f"{slowest['seconds']:.1f} s of {waits['targets_s'][slowest['figure']]:g} s",
                "met" if not late else "missed",
                "bench.waits",
            )
        )
        fraction = waits["lease"]["fraction"]
        out.append(
            (
                "a holder that cannot renew stops after 0.75-1.0 of its lease",
                f"{fraction:.2f} of a 6 s lease",
                "met" if 0.75 <= fraction < 1.0 else "missed",
                "bench.waits",
            )
        )
    out.append(_gpu_row(_load("gpu")))
    started_file = RESULTS / "started"
    if started_file.exists():
        wall = time.time() - float(started_file.read_text())
        out.append(
            (
                "`make bench` wall time < 15 min",
                f"{wall / 60:.1f} min",
                "met" if wall < BENCH_WALL_TARGET_S else "missed",
                "make bench",
            )
        )
    return out


def render(table: list[Row], header: Callable[[], str] = lambda: "") -> str:
    lines = [header(), "| target | figure | verdict | benchmark |", "|---|---|---|---|"]
    lines += [f"| {target} | {figure} | {verdict} | {source} |" for target, figure, verdict, source in table]
    return "\n".join(line for line in lines if line) + "\n"


def main() -> None:
    overhead = _load("overhead")
    machine = overhead["machine"] if overhead else {}
    markdown = render(rows(), lambda: "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".\n")
    print(markdown)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "targets.md").write_text(markdown)
    print(f"written: {RESULTS / 'targets.md'}")


if __name__ == "__main__":
    main()
