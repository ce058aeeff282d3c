"""Both ways of feeding the table classifier's workers (torch DataLoader, Ray Data shards): what each learns, the
CPUs each needs, and what Ray Train starts for them (which rows each worker sees: test_spec_shards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import pytest

from flows.training import training_pipeline
from raytrain_tasks.config import parameters_of
from raytrain_tasks.table_classifier.data import DatasetRef
from tests.helpers import small_config, this_ray_address

pytestmark = pytest.mark.slow


def test_torch_and_ray_data_loaders_reach_the_same_accuracy_and_only_ray_data_starts_a_dataset_manager(
    tmp_path: Path, ray_cluster: object, prefect_api: None
) -> None:
    """Ray Train would start (and make the workers wait for) a Ray Data actor at every worker-group start: a run
    without Ray Datasets (the torch DataLoader) starts none."""
    results, managers = {}, {"before": dataset_managers()}
    for loader in ("torch", "ray_data"):
        # The default cpus_per_worker (sized to the cluster): 2 workers and Ray Data on this 2-CPU Ray.
        config = small_config(tmp_path / loader, data_loader=loader, register=False, epochs=4)
        results[loader] = training_pipeline(**parameters_of(config)).fit
        managers[loader] = dataset_managers()
    assert managers["torch"] == managers["before"], managers
    assert managers["ray_data"] > managers["torch"], managers  # the count sees one where Ray Datasets are given
    torch_run, ray_data_run = results["torch"], results["ray_data"]
    assert torch_run.best_checkpoint_uri  # it trained and checkpointed
    assert torch_run.final_metrics["val_accuracy"] >= 0.9
    assert ray_data_run.final_metrics["val_accuracy"] >= 0.9
    # Same data, model and seed; only which rows share a batch differs.
    assert ray_data_run.final_metrics["val_accuracy"] == pytest.approx(
        torch_run.final_metrics["val_accuracy"], abs=0.03
    )
    assert [m["epoch"] for m in ray_data_run.history] == [0, 1, 2, 3]
    # The setting stays unset in the params; the CPUs each worker got are recorded beside it.
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'ray_data' / 'mlflow.db'}").get_run(ray_data_run.mlflow_run_id)
    assert run.data.params["cpus_per_worker"] == "0.0"
    assert run.data.tags["prefect_raytrain.cpus_per_worker"] == "1"
    for loader, fit in results.items():
        print(
            f"\n{loader}: val_accuracy {fit.final_metrics['val_accuracy']:.4f}, "
            f"{fit.final_metrics['samples_per_second']:.0f} samples/s in the last epoch"
        )


def dataset_managers() -> int:
    """Ray Train's DatasetManager actors this Ray has started, alive or dead."""
    from ray.util.state import list_actors

    return len(
        list_actors(
            address=this_ray_address(),
            filters=[("class_name", "=", "DatasetManager")],
            limit=10_000,
            raise_on_missing_output=False,
        )
    )


def test_ray_data_that_streams_needs_cpus_beside_the_workers(tmp_path: Path, ray_cluster: dict[str, float]) -> None:
    from raytrain_driver.sizing import FitPlan, check_resources, sized_for_cluster
    from raytrain_tasks.errors import ClusterError
    from raytrain_tasks.table_classifier.data import streams

    config = small_config(tmp_path, data_loader="ray_data", num_workers=2, cpus_per_worker=1.0)
    object_store = ray_cluster["object_store_memory"]
    small = DatasetRef.model_validate({**DATASET_FIELDS, "train_rows": 1_000})
    big = DatasetRef.model_validate({**DATASET_FIELDS, "train_rows": int(object_store / (4 * 8 + 16))})
    assert not streams("ray_data", small, object_store) and streams("ray_data", big, object_store)
    assert not streams("torch", big, object_store)
    # Kept in the object store: preprocessed before the workers start, so they may take every CPU.
    check_resources(config, FitPlan.of(config), ray_cluster, streams=False)
    with pytest.raises(ClusterError, match="streams its Ray Datasets.*cpus_per_worker"):
        check_resources(config, FitPlan.of(config), ray_cluster, streams=True)
    # Unset, the share leaves the streaming tasks their CPU.
    nodes = [{"CPU": ray_cluster["CPU"]}]
    unset = config.model_copy(update={"cpus_per_worker": 0.0})
    plan = sized_for_cluster(unset, nodes, streams=True)
    assert plan.cpus_per_worker == 0.75 and plan.sized
    check_resources(unset, plan, ray_cluster, streams=True)


DATASET_FIELDS: dict[str, Any] = {
    "uri": "/nowhere",
    "content_hash": "0" * 16,
    "source": "bench",
    "label_column": "label",
    "feature_names": tuple(f"f{i}" for i in range(8)),
    "class_labels": ("0", "1"),
    "train_rows": 1,
    "val_rows": 0,
    "feature_mean": (0.0,) * 8,
    "feature_std": (1.0,) * 8,
}


def test_a_retried_elastic_fit_keeps_the_cpus_per_worker_it_trained_with(
    tmp_path: Path, ray_cluster: dict[str, float], caplog: pytest.LogCaptureFixture
) -> None:
    """A fit retried after its cluster shrank keeps the share its earlier attempt trained with, and Ray Train
    starts the workers that fit at it. Seen in CI with two 1-CPU nodes, 1-2 workers sized at 1 CPU: the second
    node was lost, Prefect retried the fit, and the retry sized the share anew to fit both workers on the
    survivor's one CPU (two DDP processes at half a CPU each, slower than one). Here the earlier attempt trained
    at 2 CPUs per worker (a bigger cluster), and the retry's pre-flight on this 2-CPU Ray reads it from the failed
    MLflow run: one worker, at 2 CPUs. The plan is what the trainer starts and what the run's tag records (the
    loaders' test above reads that tag after a fit)."""
    import logging

    from raytrain_driver.preflight import check_cluster, resolve_code, shown_params
    from raytrain_tasks.config import new_run_key
    from raytrain_tasks.storage.locations import locate
    from raytrain_tasks.tracking import runs as tracking

    config = small_config(tmp_path, num_workers=1, max_workers=2, epochs=1, register=False).resolved(tmp_path, {})
    run_key = new_run_key()
    client = mlflow.MlflowClient(config.mlflow_tracking_uri)
    experiment_id = tracking.ensure_experiment(
        client, config.experiment_name, config.mlflow_tracking_uri, config.storage_path
    )
    runs = locate(config.storage_path).child("runs")
    assert check_cluster(config, runs, client, run_key).cpus_per_worker == 1.0  # a new run: sized to this Ray
    earlier_tags = {tracking.CPUS_PER_WORKER_TAG: "2"}
    params = shown_params(config, resolve_code(config))
    run_id, _ = tracking.start_or_reopen_run(client, experiment_id, run_key, run_key, earlier_tags, params)
    tracking.fail_run(client, run_id, RuntimeError("the worker group could not start: a node was lost"))

    with caplog.at_level(logging.INFO, logger="prefect_raytrain.fit"):
        plan = check_cluster(config, runs, client, run_key)
    assert (plan.cpus_per_worker, plan.min_workers, plan.max_workers) == (2.0, 1, 2), plan
    assert int(ray_cluster["CPU"] // plan.cpus_per_worker) == 1, "one worker fits at the earlier share"
    said = [record.getMessage() for record in caplog.records]
    assert any("1-2 workers x 2 CPUs each, as the run's earlier attempt trained" in line for line in said), said
