"""The TorchTrainer the fit task launches (imported when a fit starts: it loads torch), and what the project
reads of Ray Train's private modules: this file is their one adapter."""

from __future__ import annotations

import threading
from typing import Any

import ray
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
ABORT_TIMEOUT_S = 10.0


class RunTrainer(TorchTrainer):
    """TorchTrainer that starts Ray Data's per-run actor only for runs that pass Ray Datasets.

    Ray Train 2.60 creates a DatasetManager actor for every worker group, datasets or not, and the workers wait
    for it: one more process to start (about 4.5 s on 2 cores) at the first start and after every worker
    failure. With the torch DataLoader nothing ever asks it for a shard.
    """

    def _create_default_callbacks(self) -> list[Any]:
        # mypy resolves ray.train.torch to the V1 classes; V2 (which has this method) is used at runtime.
        callbacks: list[Any] = super()._create_default_callbacks()  # type: ignore[misc]
        if self.datasets:
            return callbacks
        return [callback for callback in callbacks if not isinstance(callback, DatasetsCallback)]

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
        from ray.train.v2._internal.execution.controller import TrainController

        env_vars = get_env_vars_to_propagate()
        env_vars.setdefault(
            RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
        )
        controller_cls = ray.remote(
            num_cpus=0,
            label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},  # type: ignore[attr-defined]
            runtime_env={"env_vars": env_vars},
        )(TrainController)
        with self._controller_lock:
            if self._aborted:
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

    def abort(self) -> None:
        """End the fit now, as Ray Train's own Ctrl-C does: the controller aborts its worker group, which removes
        the group's placement group, then exits; killed if it has not within ``ABORT_TIMEOUT_S``. A killed
        controller's workers die with it but its placement group outlived it (seen in a shared Ray: it held every
        CPU, and the next fits there waited for resources until their start timed out). A fit whose controller
        has not started yet never starts one."""
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


def waited_for_resources(exc: BaseException) -> WorkerGroupStartupTimeoutError | None:
    """The timeout when a fit failed because its worker group could not get its CPUs/GPUs in time (a node
    lost, a fixed worker count larger than what is left); None for any other failure."""
    cause = getattr(exc, "controller_failure", None)
    return cause if isinstance(cause, WorkerGroupStartupTimeoutError) else None
