"""A scoring run's output: what to do with what an output path holds (a table), and the commit of staged parts as
one Parquet file, on a real folder and on the real S3 server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from devtools.s3_server import LocalS3
from raytrain_driver.scoring_output import (
    METADATA_KEY,
    OutputAction,
    Provenance,
    commit,
    output_action,
    read_provenance,
    staging_location,
)
from raytrain_tasks.storage.filesystem import StorageOptions
from raytrain_tasks.storage.locations import StorageLocation, locate

PLANNED = Provenance("m", "3", "a" * 64)


@pytest.mark.parametrize(
    ("found", "overwrite", "action"),
    [
        (None, False, OutputAction.WRITE),
        (Provenance("m", "3", "a" * 64, rows=9, mlflow_run_id="r"), False, OutputAction.ALREADY_WRITTEN),
        (Provenance("m", "3", "a" * 64, rows=9), True, OutputAction.ALREADY_WRITTEN),  # nothing to replace
        (Provenance("m", "2", "a" * 64), False, OutputAction.REFUSE),  # another version's predictions
        (Provenance("m", "3", "b" * 64), False, OutputAction.REFUSE),  # of another input
        (Provenance("n", "3", "a" * 64), False, OutputAction.REFUSE),  # of another model
        (Provenance("m", "2", "a" * 64), True, OutputAction.WRITE),
        ("a Parquet file this project did not write", False, OutputAction.REFUSE),
        ("a file that is not Parquet (ArrowInvalid)", True, OutputAction.WRITE),
    ],
)
def test_an_output_path_is_written_found_written_or_left_alone(
    found: Provenance | str | None, overwrite: bool, action: OutputAction
) -> None:
    decided, why = output_action(found, PLANNED, overwrite)
    assert decided is action, why
    if action is OutputAction.REFUSE:
        assert "overwrite=true" in why and "version 3" in why


def _stage(staging: StorageLocation, parts: list[pa.Table]) -> None:
    staging.filesystem.create_dir(staging.path, recursive=True)
    for index, table in enumerate(parts):
        with staging.filesystem.open_output_stream(f"{staging.path}/part-{index}.parquet") as stream:
            pq.write_table(table, stream)


def _parts() -> list[pa.Table]:
    """Parts as Ray Data writes them: an empty block among them, outputs in Ray's tensor extension type."""
    from ray.data._internal.tensor_extensions.arrow import ArrowTensorArray

    def part(keys: list[int]) -> pa.Table:
        outputs = np.arange(len(keys) * 2, dtype=np.float32).reshape(len(keys), 2)
        labels = pa.array(["cat" if k % 2 else "dog" for k in keys])
        return pa.table({"id": keys, "prediction": labels, "output": ArrowTensorArray.from_numpy(outputs)})

    return [part([1, 2, 3]), part([]), part([4, 5])]


def test_staged_parts_become_one_file_with_its_provenance_in_one_step(tmp_path: Path) -> None:
    output = locate(str(tmp_path / "predictions.parquet"))
    (tmp_path / "predictions.parquet").write_bytes(b"yesterday's")  # what a reader sees until the commit
    staging = staging_location(output, "work", "attempt1")
    assert Path(staging.path).name.startswith("_")  # Parquet readers pass the staging folder over
    _stage(staging, _parts())
    assert commit(staging, output, Provenance("m", "3", "a" * 64, mlflow_run_id="r1")) == 5

    table = pq.read_table(tmp_path / "predictions.parquet")
    assert table["id"].to_pylist() == [1, 2, 3, 4, 5]
    output_type = table.schema.field("output").type
    assert not isinstance(output_type, pa.ExtensionType) and pa.types.is_large_list(output_type)  # any reader
    assert table["output"].to_pylist()[1] == [2.0, 3.0]
    assert read_provenance(output) == Provenance("m", "3", "a" * 64, rows=5, mlflow_run_id="r1")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["predictions.parquet"]  # no staging, no temp file


def _mismatched() -> list[pa.Table]:
    """Parts whose keys were read as numbers in one file and as text in another: they cannot make one file."""
    return [pa.table({"id": [1, 2, 3], "prediction": [0.1, 0.2, 0.3]}), pa.table({"id": ["a"], "prediction": [0.4]})]


def test_a_commit_that_fails_midway_leaves_the_output_as_it_was(tmp_path: Path) -> None:
    output = locate(str(tmp_path / "predictions.parquet"))
    pq.write_table(pa.table({"id": [9]}), tmp_path / "predictions.parquet")  # yesterday's, of other work
    staging = staging_location(output, "work", "attempt1")
    _stage(staging, _mismatched())
    with pytest.raises(pa.ArrowInvalid):
        commit(staging, output, Provenance("m", "3", "a" * 64))
    assert pq.read_table(tmp_path / "predictions.parquet")["id"].to_pylist() == [9]
    assert sorted(path.name for path in tmp_path.iterdir() if not path.name.startswith("_")) == ["predictions.parquet"]


def test_a_reruns_commit_clears_what_crashed_attempts_of_the_same_work_left(tmp_path: Path) -> None:
    """A staging folder of the same work untouched for a day is a crashed attempt's; a fresh one may be a concurrent
    attempt's, still writing its parts, and another work's is not this run's to clear."""
    import os
    import time

    from raytrain_driver.scoring_output import STALE_AFTER_S, clear_attempts

    output = locate(str(tmp_path / "predictions.parquet"))
    for attempt in ("crashed", "live"):
        _stage(staging_location(output, "work", attempt), _parts())
    _stage(staging_location(output, "other", "old"), _parts())
    day_ago = time.time() - STALE_AFTER_S - 60
    for folder in ("_staging-predictions.parquet-work-crashed", "_staging-predictions.parquet-other-old"):
        for part in (tmp_path / folder).iterdir():
            os.utime(part, (day_ago, day_ago))
    assert clear_attempts(output, "work", time.time()) == ["_staging-predictions.parquet-work-crashed"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "_staging-predictions.parquet-other-old",
        "_staging-predictions.parquet-work-live",
    ]


def test_an_output_path_that_cannot_be_read_is_refused_not_taken_for_replaceable(tmp_path: Path) -> None:
    from raytrain_tasks.errors import ScoringInputError

    (tmp_path / "predictions.parquet").mkdir()  # something there this run cannot open
    with pytest.raises(ScoringInputError, match="output_path .* cannot read what is there"):
        read_provenance(locate(str(tmp_path / "predictions.parquet")))


def test_what_an_output_path_holds_is_read_from_its_own_footer(tmp_path: Path) -> None:
    assert read_provenance(locate(str(tmp_path / "none.parquet"))) is None
    (tmp_path / "text.parquet").write_text("id,prediction\n1,0.5\n")
    assert "not Parquet" in str(read_provenance(locate(str(tmp_path / "text.parquet"))))
    pq.write_table(pa.table({"id": [1]}), tmp_path / "foreign.parquet")
    assert "did not write" in str(read_provenance(locate(str(tmp_path / "foreign.parquet"))))
    garbled = pa.table({"id": [1]}).replace_schema_metadata({METADATA_KEY: b"{not json"})
    pq.write_table(garbled, tmp_path / "garbled.parquet")
    assert "cannot be read" in str(read_provenance(locate(str(tmp_path / "garbled.parquet"))))


def test_on_s3_the_output_object_appears_once_whole(s3_server: LocalS3) -> None:
    from raytrain_tasks.storage.locations import create_bucket_in_region, s3_client

    options = StorageOptions(endpoint_url=s3_server.endpoint_url)
    create_bucket_in_region(s3_client(options), "prt-scoring")
    output = locate("s3://prt-scoring/daily/predictions.parquet", options)
    staging = staging_location(output, "work", "attempt1")
    _stage(staging, _parts())
    assert not output.exists()
    failed = staging_location(output, "work", "attempt0")
    _stage(failed, _mismatched())
    with pytest.raises(pa.ArrowInvalid):
        commit(failed, output, Provenance("m", "3", "a" * 64))
    assert not output.exists()  # an upload cut short publishes nothing
    assert commit(staging, output, Provenance("m", "3", "a" * 64)) == 5
    assert read_provenance(output) == Provenance("m", "3", "a" * 64, rows=5)
    keys = s3_client(options).list_objects_v2(Bucket="prt-scoring", Prefix="daily/").get("Contents", [])
    objects = [item["Key"] for item in keys if not item["Key"].endswith("/") and "attempt0" not in item["Key"]]
    assert objects == ["daily/predictions.parquet"]  # the committed attempt's parts are gone


def test_an_output_over_s3s_single_copy_limit_is_copied_in_parts_and_appears_whole(
    s3_server: LocalS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 refuses a single copy over 5 GiB: such an output goes over in parts (here the limit is lowered to 0 and a
    part is 5 MiB, S3's least), and a copy that fails midway publishes nothing and leaves no upload open."""
    import raytrain_driver.scoring_output as scoring_output
    from raytrain_tasks.storage.locations import create_bucket_in_region, s3_client

    options = StorageOptions(endpoint_url=s3_server.endpoint_url)
    client = s3_client(options)
    create_bucket_in_region(client, "prt-large")
    output = locate("s3://prt-large/daily/predictions.parquet", options)
    staging = staging_location(output, "work", "attempt1")
    noise = np.random.default_rng(0).random(1_500_000)  # about 12 MiB that Parquet cannot compress
    _stage(staging, [pa.table({"id": np.arange(len(noise)), "prediction": noise})])
    monkeypatch.setattr(scoring_output, "SINGLE_COPY_LIMIT", 0)
    monkeypatch.setattr(scoring_output, "COPY_PART", 5 * 1024**2)

    with pytest.raises(OSError, match="output_path: could not copy the predictions"):
        scoring_output.copy_in_parts(client, f"{staging.uri}/gone.parquet", output.uri, 12 * 1024**2, 5 * 1024**2)
    assert not output.exists()
    assert not client.list_multipart_uploads(Bucket="prt-large").get("Uploads")
    with pytest.raises(OSError, match="output_path: could not copy the predictions to s3://prt-no-such-bucket/"):
        scoring_output.copy_in_parts(
            client, staging.uri, "s3://prt-no-such-bucket/p.parquet", 12 * 1024**2, 5 * 1024**2
        )

    assert commit(staging, output, Provenance("m", "3", "a" * 64)) == len(noise)
    head = client.head_object(Bucket="prt-large", Key="daily/predictions.parquet")
    parts = -(-head["ContentLength"] // (5 * 1024**2))
    assert parts > 1 and head["ETag"].strip('"').endswith(f"-{parts}")  # a multipart upload's ETag counts its parts
    written = pq.read_table("prt-large/daily/predictions.parquet", filesystem=output.filesystem)
    assert written["prediction"].to_numpy().tolist() == noise.tolist()
    assert read_provenance(output) == Provenance("m", "3", "a" * 64, rows=len(noise))
