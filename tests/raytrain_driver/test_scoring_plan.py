"""A scoring run's plan, on a real SQLite registry holding pt2 models as this project logs them, with real input
files: what it resolves, and everything it refuses before Ray starts, each naming the setting to change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from raytrain_driver.scoring import plan_scoring
from raytrain_driver.scoring_output import OutputAction, Provenance, commit, staging_location
from raytrain_tasks.errors import ScoringInputError, TrackingError
from raytrain_tasks.scoring.config import ScoringConfig
from raytrain_tasks.storage.locations import locate
from tests.helpers import free_port, seed_mlflow_store
from tests.registered_versions import register_pt2


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("scoring-registry")
    store = f"sqlite:///{seed_mlflow_store(workdir / 'mlflow.db')}"
    register_pt2(store, "four", width=4, outputs=1)
    register_pt2(store, "four", width=4, outputs=1)  # version 2: the champion now
    register_pt2(store, "labelled", 2, 2, {"feature_names": ["b", "d"], "class_labels": ["cat", "dog"]})
    rng = np.random.default_rng(0)
    table = pd.DataFrame({"id": np.arange(20), **{name: rng.random(20) for name in "abcd"}})
    (workdir / "csv").mkdir()
    table[:10].to_csv(workdir / "csv" / "part-0.csv", index=False)
    table[10:].to_csv(workdir / "csv" / "part-1.csv", index=False)
    (workdir / "csv" / "_SUCCESS").write_text("")  # a marker other tools write: not part of the input
    table.to_parquet(workdir / "table.parquet")
    return {"workdir": workdir, "store": store, "table": table}


def config(registry: dict[str, Any], **settings: Any) -> ScoringConfig:
    values = {
        "model": "models:/four@champion",
        "input_path": str(registry["workdir"] / "csv"),
        "output_path": str(registry["workdir"] / "out" / "predictions.parquet"),
        "mlflow_tracking_uri": registry["store"],
    }
    return ScoringConfig(**{**values, **settings})


def test_a_plan_resolves_the_alias_once_and_reads_the_inputs_columns_and_hash(
    registry: dict[str, Any], tmp_path: Path
) -> None:
    plan = plan_scoring(config(registry), tmp_path)
    assert (plan.model.name, plan.model.version, plan.model.alias) == ("four", "2", "champion")
    assert plan.model.uri == "models:/four/2" and plan.model.inputs.width == 4
    assert [Path(f).name for f in plan.table.files] == ["part-0.csv", "part-1.csv"]
    assert plan.features.features == ("a", "b", "c", "d") and plan.action is OutputAction.WRITE
    assert (tmp_path / "data" / "model.pt2").exists() and "data/model.pt2" in plan.model.files_sha256
    again = plan_scoring(config(registry), tmp_path / "again")
    assert again.table.sha256 == plan.table.sha256  # the same bytes, the same hash
    by_version = plan_scoring(config(registry, model="models:/four/1"), tmp_path / "v1")
    assert by_version.model.version == "1" and by_version.model.alias == ""
    labelled = plan_scoring(config(registry, model="models:/labelled@champion"), tmp_path / "labelled")
    assert labelled.features.features == ("b", "d") and labelled.model.inputs.class_labels == ("cat", "dog")
    parquet = plan_scoring(config(registry, input_path=str(registry["workdir"] / "table.parquet")), tmp_path / "pq")
    assert parquet.table.format == "parquet" and parquet.table.sha256 != plan.table.sha256


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"model": "models:/nobody@champion"}, "check `model`"),
        ({"model": "models:/four@canary"}, "check `model`"),
        ({"model": "models:/four/9"}, "check `model`"),
        ({"model": "models:/four"}, "give models:/NAME@ALIAS"),
        ({"key_column": "row"}, "no column 'row' (key_column)"),
        ({"model": "models:/labelled/1", "input_path": "table.parquet"}, None),  # fits: b and d are there
        ({"input_path": "missing"}, "does not exist"),
    ],
)
def test_what_cannot_be_scored_is_refused_before_ray_starts(
    registry: dict[str, Any], tmp_path: Path, settings: dict[str, Any], named: str | None
) -> None:
    if "input_path" in settings:
        settings = {**settings, "input_path": str(registry["workdir"] / settings["input_path"])}
    if named is None:
        assert plan_scoring(config(registry, **settings), tmp_path).action is OutputAction.WRITE
        return
    with pytest.raises(ScoringInputError, match=named.replace("(", r"\(").replace(")", r"\)")):
        plan_scoring(config(registry, **settings), tmp_path)


def test_inputs_of_text_columns_mixed_kinds_or_other_columns_are_refused(
    registry: dict[str, Any], tmp_path: Path
) -> None:
    table: pd.DataFrame = registry["table"]
    (tmp_path / "text").mkdir()
    table.assign(c=["x"] * len(table)).to_csv(tmp_path / "text" / "t.csv", index=False)
    with pytest.raises(ScoringInputError, match="columns c are not numbers"):
        plan_scoring(config(registry, input_path=str(tmp_path / "text")), tmp_path / "m1")
    (tmp_path / "mixed").mkdir()
    table.to_csv(tmp_path / "mixed" / "a.csv", index=False)
    table.to_parquet(tmp_path / "mixed" / "b.parquet")
    with pytest.raises(ScoringInputError, match="a folder of files of one of these kinds"):
        plan_scoring(config(registry, input_path=str(tmp_path / "mixed")), tmp_path / "m2")
    (tmp_path / "other").mkdir()
    table.to_csv(tmp_path / "other" / "a.csv", index=False)
    table.drop(columns=["d"]).to_csv(tmp_path / "other" / "b.csv", index=False)
    with pytest.raises(ScoringInputError, match="every file of the input needs the same columns"):
        plan_scoring(config(registry, input_path=str(tmp_path / "other")), tmp_path / "m3")


def test_an_unreachable_registry_is_refused_naming_the_setting(registry: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(TrackingError, match="check `mlflow_tracking_uri`"):
        plan_scoring(config(registry, mlflow_tracking_uri=f"http://127.0.0.1:{free_port()}"), tmp_path)


def test_a_model_with_files_this_project_never_writes_is_not_loaded(registry: dict[str, Any], tmp_path: Path) -> None:
    """Someone wrote a pickle beside a version's pt2 archive in the artifact store: MLflow would unpickle it."""
    store = registry["store"]
    version = register_pt2(store, "tampered", width=4, outputs=1)
    source = MlflowClient(store, registry_uri=store).get_model_version_download_uri("tampered", version)
    (Path(source.removeprefix("file://")) / "data" / "model.pth").write_bytes(b"not a model")
    with pytest.raises(ScoringInputError, match="never writes"):
        plan_scoring(config(registry, model="models:/tampered@champion"), tmp_path)


def test_an_output_of_the_same_work_is_found_written_and_one_of_other_work_is_not_replaced(
    registry: dict[str, Any], tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    output = str(tmp_path / "predictions.parquet")
    plan = plan_scoring(config(registry, output_path=output), tmp_path / "m1")
    target = locate(output)
    staging = staging_location(target, "work", "t")
    Path(staging.path).mkdir()
    pq.write_table(pa.table({"id": [1, 2], "prediction": [0.1, 0.2]}), f"{staging.path}/part-0.parquet")
    assert commit(staging, target, Provenance(**{**plan.provenance.__dict__, "mlflow_run_id": "r1"})) == 2

    assert plan_scoring(config(registry, output_path=output), tmp_path / "m2").action is OutputAction.ALREADY_WRITTEN
    other = config(registry, output_path=output, model="models:/four/1")
    with pytest.raises(ScoringInputError, match="overwrite=true"):
        plan_scoring(other, tmp_path / "m3")
    replaced = plan_scoring(other.model_copy(update={"overwrite": True}), tmp_path / "m4")
    assert replaced.action is OutputAction.WRITE and "replaced on request" in replaced.why


def test_a_parquet_input_with_missing_feature_values_is_refused_before_scoring(
    registry: dict[str, Any], tmp_path: Path
) -> None:
    table: pd.DataFrame = registry["table"].copy()
    table.loc[3, "b"] = None
    table.to_parquet(tmp_path / "gaps.parquet")
    with pytest.raises(ScoringInputError, match="1 rows without a value in the feature column 'b'"):
        plan_scoring(config(registry, input_path=str(tmp_path / "gaps.parquet")), tmp_path / "m")
    # A column the model does not take may have gaps.
    labelled = config(registry, model="models:/labelled@champion", input_path=str(tmp_path / "gaps.parquet"))
    table.loc[3, "b"] = 0.5
    table.loc[4, "a"] = None
    table.to_parquet(tmp_path / "gaps.parquet")
    assert plan_scoring(labelled, tmp_path / "m2").action is OutputAction.WRITE


def test_a_csv_key_is_read_as_the_text_it_is(registry: dict[str, Any], tmp_path: Path) -> None:
    """`00123` stays `00123`: a key is copied, not read as a number."""
    (tmp_path / "padded.csv").write_text("id,a,b,c,d\n00123,1,2,3,4\n00124,1,2,3,4\n")
    plan = plan_scoring(config(registry, input_path=str(tmp_path / "padded.csv")), tmp_path / "m")
    assert "id" not in plan.table.numeric and set(plan.table.numeric) == set("abcd")


def test_an_input_replaced_after_it_was_hashed_is_found_before_the_output_is_committed(
    registry: dict[str, Any], tmp_path: Path
) -> None:
    from raytrain_driver.scoring_input import check_unchanged

    registry["table"].to_csv(tmp_path / "today.csv", index=False)
    given = config(registry, input_path=str(tmp_path / "today.csv"))
    plan = plan_scoring(given, tmp_path / "m")
    check_unchanged(given, plan.table)  # as it was
    registry["table"].head(5).to_csv(tmp_path / "today.csv", index=False)
    with pytest.raises(ScoringInputError, match="changed while it was scored; nothing was written"):
        check_unchanged(given, plan.table)


def test_a_local_path_on_a_cluster_of_several_nodes_is_refused_naming_the_setting() -> None:
    from raytrain_driver.sizing import storage_shared_with_nodes

    storage_shared_with_nodes("/data/out.parquet", 1, "", "output_path")  # one node: its own disk is fine
    storage_shared_with_nodes("s3://b/out.parquet", 3, "", "output_path")
    with pytest.raises(Exception, match="output_path '/data/out.parquet' is a local path .* set `output_path`"):
        storage_shared_with_nodes("/data/out.parquet", 3, "/dev/sda1 / ext4 rw 0 0", "output_path")
