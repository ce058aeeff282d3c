"""`python -m flows.training --num-workers 2 --epochs 3 ...`: every config field as a kebab-case flag."""

from __future__ import annotations

import argparse
import contextvars
import gc
import os
import re
import signal
import sys
import threading
import time
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from prefect.exceptions import TerminationSignal
from pydantic import ValidationError

from flows.console import quiet_console
from flows.shorthand import SHORTHAND, moved_flag_problem, with_shorthand
from flows.stop_signals import (
    MARK_KILLED_WITHIN_S,
    mark_run_killed,
    note_run_key,
    noted_run_key,
    send_again_a_stop_that_a_finalizer_swallowed,
)
from raytrain_driver.cluster import RaySettings
from raytrain_driver.process_groups import end_ray_groups
from raytrain_tasks.config import TrainingConfig, describe_validation_error, parameters_of
from raytrain_tasks.errors import ClusterError, RunLeaseLostError
from raytrain_tasks.redact import redact, redact_uri, strip_credentials
from raytrain_tasks.scoring.config import ScoringConfig
from raytrain_tasks.tracking.runs import opened_here

AnyConfig = typing.TypeVar("AnyConfig", TrainingConfig, ScoringConfig)  # a run's settings: training or scoring


def build_parser(prog: str = "python -m flows.training") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the training pipeline (prepare-data -> distributed-fit -> register-model) once.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        # A removed flag must not pass for a longer one it begins (--model for --model-name).
        allow_abbrev=False,
    )
    for name, field in TrainingConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = (field.description or field.title or name) + _default_text(
            field.get_default(call_default_factory=True)
        )
        options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        if annotation is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif origin is dict:  # a JSON object, given as its text
            options["type"] = str
            options["metavar"] = "JSON"
        elif origin is typing.Literal:
            options["choices"] = typing.get_args(annotation)
        elif isinstance(annotation, type) and annotation in (int, float, str):
            options["type"] = annotation
        elif isinstance(annotation, types.UnionType):  # pragma: no cover - no such field today
            options["type"] = str
        parser.add_argument(flag, **options)
    shorthand = parser.add_argument_group(
        "the table classifier's settings (the default train_code), as shorthand for --train-config keys"
    )
    for name, help_text in SHORTHAND.items():
        shorthand.add_argument("--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS, help=help_text)
    return parser


def _default_text(default: Any) -> str:
    """ " (default: X)" for a flag's help; "" where the default is unset (empty)."""
    if default is None or default == "" or default == {}:
        return ""
    return f" (default: {default})"


def parse_args(
    argv: Sequence[str] | None = None, prog: str = "python -m flows.training"
) -> tuple[TrainingConfig, bool]:
    """(the config the flags describe, --verbose); exits with status 2 and the invalid fields named otherwise."""
    parser = build_parser(prog)
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="Show everything on the console: every Ray process's output, Ray's, MLflow's and Prefect's own "
        "messages. Without it, the pipeline's progress, its summary and warnings that need you.",
    )
    known, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(moved_flag_problem(unknown))
    overrides = vars(known)
    verbose = bool(overrides.pop("verbose"))
    overrides = with_shorthand(overrides, parser)
    try:
        return TrainingConfig(**overrides), verbose
    except ValidationError as exc:
        parser.exit(2, describe_validation_error(exc) + "\n")


def parse_config(argv: Sequence[str] | None = None, prog: str = "python -m flows.training") -> TrainingConfig:
    """The config the flags describe; exits with status 2 and the invalid fields named otherwise."""
    return parse_args(argv, prog)[0]


def main(
    pipeline: Callable[..., Any], argv: Sequence[str] | None = None, prog: str = "python -m flows.training"
) -> int:
    """Run the pipeline once as this process's whole job; the exit status says whether it completed."""
    config, verbose = parse_args(argv, prog)
    config = credentials_to_environment(config)
    if problem := _train_code_problem(config):  # in seconds, before Prefect and Ray start
        print(f"\npipeline failed: {redact(problem)}", file=sys.stderr)
        return 2
    if not verbose:
        quiet_console()
    note_run_key(None)  # this command's run has no key yet
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    _exit_at_the_latest_after_a_signal(config)
    unraisable_hook = send_again_a_stop_that_a_finalizer_swallowed()
    try:
        with local_services(config):
            state = pipeline(**parameters_of(config), return_state=True)
    except ClusterError as exc:
        print(f"\npipeline failed: {redact(str(exc))}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, TerminationSignal) as exc:
        end_ray_groups()  # stopped while Ray was starting, before ray_session could stop it: none of it outlives us
        signum = exc.signal if isinstance(exc, TerminationSignal) else signal.SIGINT
        print(f"\npipeline stopped by {signal.Signals(signum).name}{_how_to_continue(config)}", file=sys.stderr)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = unraisable_hook
    if not state.is_completed():
        failure = state.result(raise_on_failure=False)
        # A driver that lost its run's lease was stopped so that another can go on: not this command's to continue.
        continues = not isinstance(failure, RunLeaseLostError)
        print(
            f"\npipeline {state.name.lower()}: {_in_cli_words(redact(str(failure)), config, continues)}",
            file=sys.stderr,
        )
        return 1
    print(format_summary(state.result()))
    # The process ends next: spare CPython's shutdown its full collections over the ~1M objects that Prefect,
    # MLflow, Ray and torch leave (about 4 s on 2 cores). atexit handlers still run.
    gc.freeze()
    return 0


def _stop(signum: int, frame: types.FrameType | None) -> None:
    """SIGTERM or SIGHUP outside a Prefect run (starting Ray or the temporary API): stop as on Ctrl-C. Inside the
    run, Prefect's own handler takes them and the run ends Crashed (the fit marks its MLflow run KILLED)."""
    raise TerminationSignal(signal=signum)


# A stop requested by a signal ends the process within this many seconds, whatever it is waiting on.
STOP_DEADLINE_S = 10.0


def _exit_at_the_latest_after_a_signal(config: TrainingConfig) -> None:
    """A deadline on stopping: after a SIGTERM, SIGINT or SIGHUP, the run normally stops in a few seconds (Prefect
    turns the signal into a cancellation, the fit marks its MLflow run KILLED). If it is still running
    ``STOP_DEADLINE_S`` later (a signal between the fit and register-model can take that long), the process
    exits with 128 + the signal; the services it started end with it (raytrain_driver.process_groups,
    flows.temporary_api), and the MLflow run it drives is marked KILLED (``flows.stop_signals.mark_run_killed``).

    Python writes every signal's number to the wakeup fd, whichever handler (ours, Prefect's) then runs it.
    """
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: no deadline
        return

    def watch() -> None:
        while True:
            received = os.read(read_end, 1)
            if received and received[0] in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                break
        time.sleep(STOP_DEADLINE_S)
        name = signal.Signals(received[0]).name
        marking = threading.Thread(
            target=mark_run_killed, args=(config, name, STOP_DEADLINE_S), name="stop-mark", daemon=True
        )
        try:
            marking.start()
            print(
                f"\npipeline stopped by {name}: still stopping after {STOP_DEADLINE_S:g} s, "
                f"exiting{_how_to_continue(config)}",
                file=sys.stderr,
                flush=True,
            )
            end_ray_groups()
            marking.join(timeout=MARK_KILLED_WITHIN_S)
        finally:  # a terminal gone after SIGHUP fails the print (EIO): the process still exits
            os._exit(128 + received[0])

    threading.Thread(target=watch, name="stop-deadline", daemon=True).start()


def _train_code_problem(config: TrainingConfig) -> str:
    """Why ``train_code`` cannot run (it does not import, names nothing, or cannot register as asked); "" if it can.
    The flow checks it again where it runs (prepare-data, and the fit's pre-flight on the cluster)."""
    from raytrain_driver.preflight import check_long_run_settings, code_model_name, resolve_code
    from raytrain_tasks.errors import SettingsError, UserCodeError

    try:
        code_model_name(config)
        check_long_run_settings(config, resolve_code(config), ray_data=False)  # Ray Datasets: the fit checks them
    except (SettingsError, UserCodeError) as exc:
        return str(exc)
    return ""


_RESUME_PARAMETER = re.compile(r"(?<![\w-])(`?)resume=(\d{8}-\d{6}-[0-9a-f]{6})\1")


def _continue_command(config: TrainingConfig, run_key: str) -> str:
    """The command that continues run ``run_key``: `resume`, or for a Ray Job run `train` with its flags, which
    re-attaches to its job (`resume` would continue it as a plain driver in this process)."""
    if config.launch_mode == "ray_job":
        return f"prefect-raytrain train <the same flags> --resume {run_key}"
    return f"prefect-raytrain resume {run_key}"


def _in_cli_words(error: str, config: TrainingConfig, continues: bool = True) -> str:
    """A failed run's error as the console shows it: where it says how to continue the run in the flow parameter's
    form (``resume=<run key>``, what a deployment's user gives), the command's form instead, and (``continues``)
    that command again on the last line."""
    found = _RESUME_PARAMETER.search(error)
    if not found:
        return error
    error = _RESUME_PARAMETER.sub(lambda m: f"`{_continue_command(config, m.group(2))}`", error)
    return f"{error}\n\ncontinue it with: {_continue_command(config, found.group(2))}" if continues else error


def _how_to_continue(config: TrainingConfig) -> str:
    """How a stopped command's run goes on: the command that continues it, once there is a run to continue."""
    run_key = config.resume or noted_run_key()
    if run_key and (config.resume or config.launch_mode == "ray_job" or opened_here(run_key)):
        return f"; continue it with `{_continue_command(config, run_key)}`"
    return "; it stopped before its MLflow run was started (nothing trained): start it again"


def credentials_to_environment(config: AnyConfig) -> AnyConfig:
    """Move a ``user:password@`` out of ``--mlflow-tracking-uri`` into MLFLOW_TRACKING_USERNAME / _PASSWORD.

    The flow's parameters are stored by Prefect as given; what is in this process's environment is not. MLflow
    reads the two variables for basic auth; a value already set there wins.
    """
    uri, user, password = strip_credentials(config.mlflow_tracking_uri)
    if not user and not password:
        return config
    os.environ.setdefault("MLFLOW_TRACKING_USERNAME", user)
    os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", password)
    return config.model_copy(update={"mlflow_tracking_uri": uri})


@contextmanager
def local_services(config: RaySettings) -> Iterator[None]:
    """Start the temporary Prefect API and the local Ray side by side, when the run would start both.

    Each takes seconds of start-up in which this process mostly waits; one after the other they were most of a
    short run's fixed cost. Meanwhile the libraries the run needs later are imported. The fit task finds Ray
    initialised and leaves it to this block, which stops it at the end. A configured Prefect API
    (`PREFECT_API_URL`) or Ray cluster (`ray_address`) is used as before.
    """
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value() or config.ray_address:
        yield
        return
    from raytrain_driver.cluster import ray_session

    failure: list[BaseException] = []
    cancelled, started, server_imported = threading.Event(), threading.Event(), threading.Event()

    def start_server() -> None:
        try:
            try:
                from prefect.server.api.server import SubprocessASGIServer

                from flows.temporary_api import temporary_api_in_its_own_group
            finally:
                server_imported.set()
            temporary_api_in_its_own_group()
            if not cancelled.is_set():
                SubprocessASGIServer().start()  # the instance Prefect's client uses, and stops at exit
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            failure.append(exc)
        finally:
            started.set()
        # The server dies with the thread that started it (flows.temporary_api): this one lives as long as the
        # process, so a killed run (SIGKILL, out of memory) takes its temporary API along.
        threading.Event().wait()

    # Prefect's settings live in context variables: the starter thread needs this thread's.
    helpers = [
        threading.Thread(target=contextvars.copy_context().run, args=(start_server,), daemon=True),
        threading.Thread(target=_import_ahead, args=(PRELOADED_MODULES, server_imported), daemon=True),
    ]
    for helper in helpers:
        helper.start()
    try:
        with ray_session(config):
            _import_ahead(["ray.train.torch"])  # after ray.init: no two threads import Ray modules at once
            started.wait()
            helpers[1].join()
            if failure:
                raise failure[0]
            yield
    except BaseException:
        cancelled.set()
        _stop_starting_server(started)
        raise
    finally:
        # The server's start is waited for even after a signal: Prefect stops at exit only a server whose
        # process it has already started. The imports ahead are not (they end with the process).
        started.wait()


def _stop_starting_server(started: threading.Event, within_s: float = 10.0) -> None:
    """A signal (or a failure) while the temporary API is still starting (its first migrations take 10 s and more
    on 2 cores): end its process now rather than wait for it to answer. The starter then fails and returns."""
    if started.is_set():
        return
    from prefect.server.api.server import SubprocessASGIServer

    deadline = time.monotonic() + within_s
    while not started.is_set() and time.monotonic() < deadline:
        server = SubprocessASGIServer()
        if server.server_process is not None:
            server.server_process.kill()
            server.stop()
        started.wait(timeout=0.1)


# What the run imports later, about 9 s on 2 cores: torch, MLflow and its SQL store, the evaluation report, and
# torch.export, which MLflow's default model format (pt2) loads when register-model logs the model.
PRELOADED_MODULES = (
    "torch",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "sklearn.metrics",
    "torch.export._trace",
    "mlflow.pytorch",
)


def _import_ahead(modules: Sequence[str], server_imported: threading.Event | None = None) -> None:
    """Import ``modules`` before they are used; one that fails here fails again, with its error, where used.

    MLflow's modules wait until Prefect's server modules are imported (``server_imported``): SQLAlchemy configures
    every mapper of the process at once, and MLflow's store doing so while another thread was still defining
    Prefect's ORM classes failed for the rest of the process ("expression 'WorkQueue' failed to locate a name")."""
    import importlib

    for name in modules:
        if server_imported is not None and name.startswith("mlflow"):
            server_imported.wait()
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 - see the docstring
            continue


def format_summary(result: Any) -> str:
    fit, model = result.fit, result.model
    final = fit.final_metrics
    shown = fit.shown_metrics or tuple(sorted(final))
    metrics = " ".join(f"{key}={final[key]:.4g}" for key in shown if key in final)
    lines = [
        "",
        "training pipeline finished",
        f"  run key        {result.run_key}",
        f"  MLflow run     {fit.mlflow_run_id} (experiment {result.config.experiment_name!r}, "
        f"{redact_uri(result.config.mlflow_tracking_uri)})",
        f"  epochs         {fit.epochs_completed}, {result.config.num_workers} workers ({fit.backend})",
        f"  final metrics  {metrics}",
        f"  checkpoints    {fit.run_uri} (best: epoch {fit.best_epoch})",
    ]
    if fit.scores:  # the best checkpoint's, held-out ones among them: what the gate compares
        lines.append("  best scores    " + " ".join(f"{key}={value:.4g}" for key, value in sorted(fit.scores.items())))
    if model is None:
        lines.append("  model          not registered (--no-register)")
    else:
        aliases = ", ".join(model.aliases) or "no alias"
        lines.append(f"  model          {model.name} version {model.version} -> {aliases} ({model.reason})")
    return "\n".join(lines)
