"""The TorchTrainer the fit task launches (imported when a fit starts: it loads torch), and what the project
reads of Ray Train's private modules: this file is their one adapter."""

from __future__ import annotations

import contextvars
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import ray.train
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
from ray.train.v2._internal.execution.callback import WorkerGroupCallback
from ray.train.v2.api.callback import RayTrainCallback

from raytrain_driver import hooks
from raytrain_driver.cluster import WORKER_GROUP_START_TIMEOUT_S
from raytrain_driver.lease import HeldLease
from raytrain_driver.preflight import workers_code_dir
from raytrain_driver.sizing import FitPlan
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import (
    CheckpointError,
    DataRefusedError,
    RepeatedFailureError,
    RunLeaseLostError,
    TrainingError,
    UnverifiedCheckpointError,
    UserCodeError,
)
from raytrain_tasks.long_runs import hang_timeout_s
from raytrain_tasks.tracking.names import RANK_SCORE_KEY

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from raytrain_driver.fit_context import FitContext
    from raytrain_driver.fit_record import ResumePoint

START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
HEALTH_CHECK_TIMEOUT_ENV = "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"
TORCH_SHUTDOWN_ENV, TORCH_SHUTDOWN_S = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "2"
ABORT_TIMEOUT_S = 10.0


class PlacementGroupRecord(WorkerGroupCallback):  # type: ignore[misc]  # Ray's private base
    """Writes the id of each worker group's placement group to ``path``, on the controller's node (the driver's:
    ``RunTrainer`` places the controller there), for ``remove_recorded_placement_group``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def after_worker_group_start(self, worker_group: Any) -> None:
        group = worker_group.get_worker_group_state().placement_group_handle.placement_group
        Path(self.path).write_text(group.id.hex())


def remove_recorded_placement_group(path: str) -> None:
    """Remove the placement group ``PlacementGroupRecord`` wrote to ``path`` unless Ray already did, and the
    file. A controller that ends normally or aborts removes its group itself; one that was killed or died leaves
    it holding its CPUs for as long as the driver lives (a served warm Ray, the test suite's)."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    try:
        recorded = Path(path).read_text().strip()
        Path(path).unlink()
    except FileNotFoundError:  # removed already (by abort or the fit's own end), or no group ever started
        return
    if not recorded:
        return
    group = PlacementGroup(PlacementGroupID(bytes.fromhex(recorded)))
    if placement_group_table(group).get("state", "REMOVED") != "REMOVED":
        remove_placement_group(group)


class RunTrainer(TorchTrainer):
    """TorchTrainer that starts no actor a run does not need, and is stopped by ``abort``.

    Ray Train 2.60 creates a DatasetManager actor for every worker group, datasets or not, and the workers wait
    for it: one more process to start (about 4.5 s on 2 cores) at the first start and after every worker
    failure. With the torch DataLoader nothing ever asks it for a shard: it starts only for runs with datasets.

    Ray Train also starts a detached PlacementGroupCleaner actor per fit, polling Ray's State API every second,
    to remove the worker group's placement group if the controller dies: 1.4 s of a fit's wall time and 1 s of
    CPU on 2 cores. The fit does that itself instead: ``PlacementGroupRecord`` notes
    the group, and the driver removes it when the controller is gone (``remove_recorded_placement_group``).
    """

    _placement_group_record = ""
    ended_from_outside = False  # Ray Tune may end this fit's process at any moment (hooks.RunHooks.ended_from_outside)
    hang_timeout_s = 0  # the fit's `hang_timeout_s` when set (0: Ray's own health-check timeout, 10 minutes)

    def _create_default_callbacks(self) -> list[Any]:
        # mypy resolves ray.train.torch to the V1 classes; V2 (which has this method) is used at runtime.
        callbacks: list[Any] = super()._create_default_callbacks()  # type: ignore[misc]
        # A fit ended from outside at any moment (a sweep's trial that Ray Tune stops) keeps Ray's cleaner: no
        # driver of ours is left to remove the worker group's placement group, which would hold its CPUs.
        unneeded: tuple[type, ...] = () if self.ended_from_outside else (PlacementGroupCleanerCallback,)
        if not self.datasets:
            unneeded += (DatasetsCallback,)
        handle, self._placement_group_record = tempfile.mkstemp(prefix="prt-placement-group-")
        os.close(handle)
        kept = [callback for callback in callbacks if not isinstance(callback, unneeded)]
        return [*kept, PlacementGroupRecord(self._placement_group_record)]

    _controller: Any = None
    _aborted = False
    _controller_lock = threading.Lock()

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        """Ray Train 2.60's own (``DataParallelTrainer._initialize_and_run_controller``, the main-thread SIGINT
        handler left out: the fit runs off the main thread), keeping the controller's handle for ``abort``."""
        from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
        from ray.train.v2._internal.constants import (
            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            get_env_vars_to_propagate,
        )

        from raytrain_driver.retention import KeepResumedController  # Ray's TrainController, retention aside

        env_vars = get_env_vars_to_propagate()
        env_vars.setdefault(
            RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
        )
        if self.hang_timeout_s:  # a frozen worker answers no poll: its group is restarted within the same bound
            env_vars.setdefault(HEALTH_CHECK_TIMEOUT_ENV, str(self.hang_timeout_s))
        # Tearing a group down first destroys its process group on every worker; a frozen worker never answers,
        # and Ray Train waits 30 s for it before it kills the workers. A healthy group's takes well under a second.
        if TORCH_SHUTDOWN_ENV not in os.environ:
            env_vars.setdefault(TORCH_SHUTDOWN_ENV, TORCH_SHUTDOWN_S)
        controller_cls = ray.remote(
            num_cpus=0,
            label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},  # type: ignore[attr-defined]
            runtime_env={"env_vars": env_vars},
        )(KeepResumedController)
        with self._controller_lock:
            if self._aborted:
                remove_recorded_placement_group(self._placement_group_record)
                raise RuntimeError("the fit was aborted before its controller started")
            controller: Any = controller_cls.remote(**controller_init_kwargs)
            self._controller = controller
        try:
            ray.get(controller.run.remote())
            return ray.get(controller.get_result.remote())
        finally:
            # As in Ray's own: the last handle dropped ends the controller actor. A handle kept on the trainer
            # (which an error's traceback can keep alive) left the failed run's controller running.
            with self._controller_lock:
                self._controller = None
            del controller
            remove_recorded_placement_group(self._placement_group_record)

    def abort(self) -> None:
        """End the fit now, as Ray Train's own Ctrl-C does: the controller aborts its worker group, which removes
        the group's placement group, then exits; killed if it has not within ``ABORT_TIMEOUT_S``. A killed
        controller's workers die with it but its placement group would outlive it (seen in a shared Ray: it held
        every CPU, and the next fits there waited for resources until their start timed out), so it is removed
        here. A fit whose controller has not started yet never starts one."""
        with self._controller_lock:
            self._aborted = True
            controller = self._controller
        if controller is None:
            return
        try:
            ray.get(controller.abort.remote(), timeout=ABORT_TIMEOUT_S)
        except ray.exceptions.RayError:  # it exits inside the call (ActorDiedError), or did not in time
            pass
        ray.kill(controller, no_restart=True)
        remove_recorded_placement_group(self._placement_group_record)


def waited_for_resources(exc: BaseException) -> WorkerGroupStartupTimeoutError | None:
    """The timeout when a fit failed because its worker group could not get its CPUs/GPUs in time (a node
    lost, a fixed worker count larger than what is left); None for any other failure."""
    cause = getattr(exc, "controller_failure", None)
    return cause if isinstance(cause, WorkerGroupStartupTimeoutError) else None


def _scaling(plan: FitPlan) -> ray.train.ScalingConfig:
    """The worker group: a fixed count, or a (min, max) pair that makes it elastic (Ray Train V2)."""
    low, high = plan.min_workers, plan.max_workers
    return ray.train.ScalingConfig(
        num_workers=(low, high) if plan.elastic else low,  # type: ignore[arg-type]
        use_gpu=plan.use_gpu,
        resources_per_worker={"CPU": plan.cpus_per_worker, **({"GPU": 1} if plan.use_gpu else {})},
    )


def build_trainer(
    fit: FitContext,
    plan: FitPlan,
    resume_point: ResumePoint | None = None,
    callbacks: Sequence[RayTrainCallback] = (),  # UserCallbacks and ControllerCallbacks; they run on the controller
    driver_stop: Any = None,
) -> TorchTrainer:
    """The run's TorchTrainer for the fit's code; its workers check the fit's lease before each checkpoint."""
    # torch loads here, not when the flow module is imported: a Prefect worker needs no CUDA to plan runs.
    from ray.train.torch import TorchConfig

    from raytrain_driver.fit_steps import trainer_function
    from raytrain_tasks.failures import StopOnRepeatedFailure

    config, run_key, runs = fit.config, fit.run_key, fit.runs
    code = workers_code_dir(config)
    hang_s = round(hang_timeout_s(config.hang_timeout_s, plan.use_gpu))
    train_func, loop_config, data = trainer_function(fit, code, resume_point, plan.fixed_workers, driver_stop)
    trainer = RunTrainer(
        train_func,
        train_loop_config=loop_config,
        # A rank that makes no progress fails its peers' next collective within this bound, not torch's 30 minutes:
        # Ray Train then restarts the group from the last checkpoint (long_runs.hang_timeout_s).
        torch_config=TorchConfig(backend=plan.backend, timeout_s=hang_s),
        **data,
        scaling_config=_scaling(plan),
        run_config=ray.train.RunConfig(
            name=run_key,
            storage_path=runs.path,
            storage_filesystem=runs.filesystem,
            failure_config=ray.train.FailureConfig(
                max_failures=config.max_failures,
                # Ray's default (-1) retries a worker group that cannot start forever.
                controller_failure_limit=max(1, config.max_failures),
            ),  # type: ignore[call-arg]  # mypy resolves ray.train to the V1 classes; V2 is used at runtime
            # Kept by the code's metric as checked_reports ranks it: finite, higher is better (a NaN in Ray's
            # record of the run is written as null, which a resume cannot read back).
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=config.checkpoints_to_keep,
                checkpoint_score_attribute=RANK_SCORE_KEY,
                checkpoint_score_order="max",
            ),
            callbacks=[*callbacks, *_on_workers(fit), StopOnRepeatedFailure(run_key)],  # type: ignore[arg-type,list-item]  # V2, see above
        ),
    )
    # Ray Train also marks a worker dead once its poll has had no answer this long (a frozen process): when set.
    trainer.hang_timeout_s = round(config.hang_timeout_s)
    trainer.ended_from_outside = hooks.ended_from_outside()
    return trainer


def _on_workers(fit: FitContext) -> list[Any]:
    """Callbacks Ray Train runs on each worker: a TrainSpec's loop commits a checkpoint before a SIGTERM ends a
    worker (raytrain_tasks.stop_requests); a train_func of the user's own does once it calls
    ``checkpoint_if_preempted``, and is left Ray's handling until then."""
    from raytrain_tasks.trainspec.loop import SpecTrainFunc
    from raytrain_tasks.trainspec.save_on_sigterm import SaveOnSigterm

    return [SaveOnSigterm(acted_on=isinstance(fit.spec.train_func, SpecTrainFunc))]


def training_error(exc: BaseException, run_key: str, config: TrainingConfig) -> BaseException:
    """What the task raises for ``exc``: a worker's CheckpointError stays one (no retry can fix it)."""
    if not isinstance(exc, ray.train.TrainingFailedError):
        return exc
    stopped = getattr(exc, "controller_failure", None)
    if isinstance(stopped, RunLeaseLostError):  # a worker found the run's lease another driver's
        return RunLeaseLostError(f"training run {run_key}: {stopped}")
    if isinstance(stopped, UserCodeError | DataRefusedError):  # raytrain_tasks.user_code.code_error_stopper
        # The workers and the controller do not know the run key: its `resume` gets it here, which the CLI then
        # shows as the command that continues the run.
        said = str(stopped).replace("`resume`", f"`resume={run_key}`")
        return type(stopped)(f"training run {run_key}: {said}")
    for failure in [*getattr(exc, "worker_failures", {}).values(), stopped]:  # the controller's: a restart check
        cause: BaseException | None = failure
        while cause is not None:
            if isinstance(cause, CheckpointError | UnverifiedCheckpointError):  # RestartGuard's, or a worker's
                return type(cause)(f"training run {run_key}: {cause}")  # UnsafeCheckpointError stays one
            cause = cause.__cause__ or getattr(cause, "cause", None)
    repeated = getattr(exc, "controller_failure", None)
    if isinstance(repeated, RepeatedFailureError):  # raytrain_tasks.failures.StopOnRepeatedFailure
        return RepeatedFailureError(f"training run {run_key} stopped: {repeated}")
    timeout = waited_for_resources(exc)
    if timeout is not None:
        low, high = config.worker_range
        waited = os.environ.get(START_TIMEOUT_ENV, WORKER_GROUP_START_TIMEOUT_S)
        return TrainingError(
            f"training run {run_key}: the cluster no longer has the resources for {timeout.num_workers} workers "
            f"(a node lost?); after {config.max_failures} worker-group restarts (`max_failures`) each waited "
            f"{START_TIMEOUT_ENV} (Ray Train's setting, {waited} s here) for them. "
            + (
                "Set `max_workers` above `num_workers` to train on what is left, lower `num_workers`, or add nodes; "
                if high == low
                else f"not even `num_workers` ({low}) could start; add nodes or lower `num_workers`; "
            )
            + f"it can continue from its last checkpoint with `resume={run_key}`"
        )
    return TrainingError(
        f"training run {run_key} failed after {config.max_failures} worker-group restarts: {exc}. "
        f"It can continue from its last checkpoint with `resume={run_key}`"
    )


def fit_interruptibly(
    trainer: TorchTrainer, lease: HeldLease | None = None, save_first: Callable[[], None] | None = None
) -> ray.train.Result:
    """``trainer.fit()``, with this thread free to take a SIGTERM (a Prefect cancellation) or Ctrl-C at once.

    ``fit()`` waits on the controller inside one ``ray.get``, and a thread blocked there runs Python's signal
    handlers only when the call returns. Seen: a SIGTERM after epoch 2 of 6 surfaced after epoch 6, as a
    ``SystemError`` that Prefect took for a failure and retried. So ``fit()`` runs in a helper thread (with this
    thread's context: Prefect's run context, for logging) and this one waits in short steps. An exception raised
    here (TerminationSignal, KeyboardInterrupt) leaves the helper behind: ending the process (or ``ray_session``
    shutting the local Ray down) ends the controller and its workers. Off the main thread, Ray Train installs
    no SIGINT handler of its own either (one that kept the controller alive after the fit).

    A lost run lease (``lease``) ends the fit at once: its controller is killed, with its workers, whatever Ray
    this is (a cluster outlives the driver's connection), and RunLeaseLostError is raised.

    ``save_first``: called when a signal stops this thread while the fit runs, before the signal goes on: the
    workers commit a checkpoint first (a TrainSpec's, within a bound).
    """
    outcome: dict[str, Any] = {}
    # Not Thread.is_alive(): a signal that interrupts Thread.join() can leave the thread marked stopped while it
    # still runs (CPython's _wait_for_tstate_lock takes its held lock for one just released).
    done = threading.Event()

    def run() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - handed over to the waiting thread as it is, whatever it is
            outcome["error"] = exc
        finally:
            done.set()

    context = contextvars.copy_context()
    helper = threading.Thread(target=context.run, args=(run,), name="ray-train-fit", daemon=True)
    helper.start()
    try:
        while not done.wait(timeout=0.2):
            if lease is not None and lease.lost() is not None:
                abort = getattr(trainer, "abort", None)
                if abort is not None:
                    abort()
                lease.check()
    except BaseException as stop:
        # A signal's exception (TerminationSignal, KeyboardInterrupt) is no Exception; a lost lease is one.
        if save_first is not None and not isinstance(stop, Exception) and not done.is_set():
            save_first()
            abort = getattr(trainer, "abort", None)
            if abort is not None:  # the driver may live on (a notebook): no restarted group trains after it
                abort()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
