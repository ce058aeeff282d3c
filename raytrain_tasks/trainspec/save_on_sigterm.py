"""The Ray Train callback that makes a TrainSpec's workers commit a checkpoint before a SIGTERM ends them
(``stop_requests``). Apart from it, so that importing the loop imports no Ray Train module: the CLI's check of the
code imports the loop before Ray starts."""

from __future__ import annotations

from ray.train.v2._internal.execution.callback import WorkerCallback

from raytrain_tasks.stop_requests import save_on_sigterm


class SaveOnSigterm(WorkerCallback):  # type: ignore[misc]  # Ray's private base
    """Installs ``save_on_sigterm`` on each worker as its group starts: Ray Train calls this on the worker actor's
    main thread, the one where Python runs signal handlers (the training function runs on another)."""

    def __init__(self, acted_on: bool = True) -> None:
        self.acted_on = acted_on  # False for a train_func: until it calls checkpoint_if_preempted

    def after_init_train_context(self) -> None:
        save_on_sigterm(self.acted_on)
