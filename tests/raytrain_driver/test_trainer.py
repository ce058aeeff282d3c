"""The trainer on the session's real local Ray, without the pipeline around it: what a fit leaves on a shared Ray.

Chaos tier: it kills a controller. Ray Train's resource request for a killed controller stays with Ray Data's
AutoscalingCoordinator until it expires (180 s), and an elastic fit on the same Ray waits for it meanwhile
(seen: 130 s instead of 11 s for test_ingest's elastic fit run after it)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from raytrain_driver.trainer import RunTrainer
from tests.helpers import this_ray_address, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.usefixtures("ray_cluster")]


def _train_until_killed(config: dict[str, str]) -> None:
    Path(config["started"]).touch()
    time.sleep(600)


def test_a_dead_controllers_placement_group_is_removed_and_its_cpus_come_back(tmp_path: Path) -> None:
    """Ray Train's PlacementGroupCleaner actor is not started (it costs every fit 1.4 s here): a controller that
    dies without aborting its worker group must not leave the group's CPUs reserved on a Ray that later fits
    share (a served warm Ray, this suite's)."""
    import ray
    import ray.train
    from ray.util.state import list_actors, list_placement_groups

    started = tmp_path / "started"
    trainer = RunTrainer(
        _train_until_killed,
        train_loop_config={"started": str(started)},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="dead-controller", storage_path=str(tmp_path)),
    )
    outcome: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - the test reads it below
            outcome["error"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    wait_for(started.exists, 120, "the workers to train")
    created = [("state", "=", "CREATED")]
    assert list_placement_groups(address=this_ray_address(), filters=created)
    assert not [
        actor
        for actor in list_actors(address=this_ray_address(), filters=[("state", "=", "ALIVE")])
        if actor.class_name == "PlacementGroupCleaner"
    ]
    controller: Any = trainer._controller
    ray.kill(controller, no_restart=True)
    thread.join(60)
    assert not thread.is_alive() and isinstance(outcome.get("error"), ray.exceptions.RayActorError)
    wait_for(
        lambda: not list_placement_groups(address=this_ray_address(), filters=created),
        30,
        "the dead controller's placement group to be removed",
    )
    wait_for(lambda: ray.available_resources().get("CPU") == 2, 30, "both CPUs free for the next fit")
