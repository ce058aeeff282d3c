"""prepare-data for your own code (``TrainFunc``/``TrainSpec`` ``prepare=``): what it writes is stored once per
content in the run's storage, and every process reads exactly those files (``config["data_dir"]``). Real local
folders and the session's real S3 server; no Ray."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from devtools.s3_server import LocalS3
from raytrain_driver.user_data import prepare_user_data
from raytrain_tasks.api import DATA_DIR_KEY, Metric, TrainFunc
from raytrain_tasks.errors import DatasetError, StorageError, UserCodeError
from raytrain_tasks.prepared import MARKER_NAME, local_data_dir
from raytrain_tasks.storage.locations import s3_client
from raytrain_tasks.user_code import user_config
from tests.helpers import small_config

CODE = "someones_project.train:training"


def code(prepare: Any) -> TrainFunc:
    return TrainFunc(lambda config: None, metric=Metric("val_loss", higher_is_better=False), prepare=prepare)


def write_rows(rows: int) -> Any:
    def prepare(config: dict[str, Any], folder: Path) -> None:
        assert config[DATA_DIR_KEY] is None and config["epochs"] == 1  # the run's config, before there is data
        (folder / "tables").mkdir()
        (folder / "tables" / "rows.csv").write_text("".join(f"{i},{2 * i}\n" for i in range(rows)))
        (folder / "labels.txt").write_text("x\ny\n")

    return prepare


def test_what_prepare_writes_is_stored_once_per_content_and_read_back_exactly(tmp_path: Path) -> None:
    config = small_config(tmp_path, train_code=CODE, epochs=1)
    first = prepare_user_data(config, code(write_rows(10)))
    assert first is not None and first.files == 2
    stored = Path(config.storage_path) / "datasets" / first.content_hash
    assert first.uri.endswith(f"/datasets/{first.content_hash}") and (stored / MARKER_NAME).is_file()
    marker_written = (stored / MARKER_NAME).stat().st_mtime_ns

    again = prepare_user_data(config, code(write_rows(10)))
    assert again == first  # the same content is the same version: found, not written again
    assert (stored / MARKER_NAME).stat().st_mtime_ns == marker_written
    other = prepare_user_data(config, code(write_rows(11)))
    assert other is not None and other.content_hash != first.content_hash  # other rows, another version

    folder = local_data_dir(first, config.storage_options)
    assert (folder / "tables" / "rows.csv").read_text().startswith("0,0\n1,2\n")
    assert user_config(config, code(write_rows(10)), folder)[DATA_DIR_KEY] == str(folder)


def test_an_interrupted_write_of_a_version_is_written_again_whole(tmp_path: Path) -> None:
    config = small_config(tmp_path, train_code=CODE, epochs=1)
    version = prepare_user_data(config, code(write_rows(5)))
    assert version is not None
    stored = Path(config.storage_path) / "datasets" / version.content_hash
    (stored / MARKER_NAME).unlink()  # as a driver killed before the marker leaves it
    (stored / "files" / "labels.txt").unlink()
    (stored / "files" / "stray.bin").write_bytes(b"half an upload")
    assert prepare_user_data(config, code(write_rows(5))) == version
    assert local_data_dir(version, config.storage_options) == stored / "files"  # its files hash right again


def test_a_stored_version_changed_afterwards_is_refused_where_it_is_read(tmp_path: Path) -> None:
    config = small_config(tmp_path, train_code=CODE, epochs=1)
    version = prepare_user_data(config, code(write_rows(5)))
    assert version is not None
    stored = Path(config.storage_path) / "datasets" / version.content_hash / "files"
    (stored / "tables" / "rows.csv").write_text("0,999\n")
    with pytest.raises(DatasetError, match=r"hash to .*not to the content") as refused:
        local_data_dir(version, config.storage_options)
    assert str(stored) in str(refused.value)


def test_a_second_run_writing_the_same_version_does_not_make_the_first_refuse_it(tmp_path: Path) -> None:
    """Two runs preparing the same new data at once: the second replaces each file whole, under a
    temporary name beside it first. A fit of the first reading the version then hashed those names too, refused
    its data and told the user to delete the folder the other run was writing."""
    config = small_config(tmp_path, train_code=CODE, epochs=1)
    version = prepare_user_data(config, code(write_rows(10)))
    assert version is not None
    files = local_data_dir(version, config.storage_options)
    staged = files / "tables" / "rows.csv.0123abcd.tmp"
    staged.write_bytes((files / "tables" / "rows.csv").read_bytes())
    assert local_data_dir(version, config.storage_options) == files  # the other writer's file is not the version's
    os.utime(staged, (time.time() - 3600, time.time() - 3600))  # left an hour ago: no writer's any more
    with pytest.raises(DatasetError, match="hash to"):
        local_data_dir(version, config.storage_options)
    staged.unlink()
    (files / "tables" / "other.csv").write_text("1,2\n")  # a file that is not the version's is still refused
    with pytest.raises(DatasetError, match="hash to"):
        local_data_dir(version, config.storage_options)


def test_a_prepare_that_fails_or_writes_nothing_is_named_before_anything_is_stored(tmp_path: Path) -> None:
    config = small_config(tmp_path, train_code=CODE, epochs=1)

    def broken_prepare(config: dict[str, Any], folder: Path) -> None:
        raise FileNotFoundError("/data/missing.csv")

    with pytest.raises(UserCodeError, match=r"prepare failed: FileNotFoundError: /data/missing.csv") as failed:
        prepare_user_data(config, code(broken_prepare))
    assert "broken_prepare" in str(failed.value)  # the user's own frame
    with pytest.raises(DatasetError, match="wrote no file"):
        prepare_user_data(config, code(lambda config, folder: None))
    assert not (Path(config.storage_path) / "datasets").exists() or not any(
        (Path(config.storage_path) / "datasets").iterdir()
    )
    assert prepare_user_data(config, code(None)) is None  # no prepare: the code reads its own data


def test_a_data_error_of_the_table_classifier_shows_no_frame_of_this_project(tmp_path: Path) -> None:
    """Its message says what is wrong with the table; frames of raytrain_driver/user_data.py and
    raytrain_tasks/table_classifier/tables.py under it read as if the user's code had failed."""
    from raytrain_driver.preflight import resolve_code

    table = tmp_path / "data.csv"
    table.write_text("colour,label\n" + "red,0\nblue,1\n" * 10)
    config = small_config(tmp_path, train_config={"dataset": str(table)}, epochs=1)
    with pytest.raises(UserCodeError, match=r"non-numeric feature columns \['colour'\]") as failed:
        prepare_user_data(config, resolve_code(config))
    assert "File " not in str(failed.value), str(failed.value)


def on_s3(workdir: Path, server: LocalS3, prefix: str) -> Any:
    """A config whose storage is the session's S3 server (the bucket made when missing)."""
    storage = f"s3://prt-tests/{prefix}"
    return small_config(
        workdir,
        train_code=CODE,
        epochs=1,
        storage_path=storage,
        s3_endpoint_url=server.endpoint_url,
        create_bucket=True,
    )


def test_on_s3_each_node_reads_a_verified_copy(
    s3_server: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "node-tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))  # this "node's" temporary directory
    config = on_s3(tmp_path, s3_server, "prepared")
    version = prepare_user_data(config, code(write_rows(7)))
    assert version is not None and version.uri == f"s3://prt-tests/prepared/datasets/{version.content_hash}"
    copy = local_data_dir(version, config.storage_options)
    assert copy == tmp_path / "node-tmp" / "prefect-raytrain-data" / version.content_hash
    assert (copy / "tables" / "rows.csv").read_text().count("\n") == 7
    assert local_data_dir(version, config.storage_options) == copy  # once per node
    (copy / "labels.txt").write_text("changed on this node\n")  # e.g. code that wrote into data_dir
    assert local_data_dir(version, config.storage_options) == copy  # copied again, from the verified version
    assert (copy / "labels.txt").read_text() == "x\ny\n"


def test_the_workers_of_one_node_make_one_copy(s3_server: LocalS3, tmp_path: Path) -> None:
    """Four processes of one node asking at once: one downloads, the others wait for it and use its copy."""
    import json
    import subprocess
    import sys

    (tmp_path / "node-tmp").mkdir()
    config = on_s3(tmp_path, s3_server, "prepared-once")
    version = prepare_user_data(config, code(write_rows(3000)))
    assert version is not None
    script = (
        "import json, sys, tempfile; tempfile.tempdir = sys.argv[1]\n"
        "from raytrain_tasks import prepared\n"
        "from raytrain_tasks.storage.filesystem import StorageOptions\n"
        "calls = []; real = prepared._download\n"
        "prepared._download = lambda *a: (calls.append(1), real(*a))[1]\n"
        "data = prepared.PreparedData.model_validate_json(sys.argv[2])\n"
        "folder = prepared.local_data_dir(data, StorageOptions.model_validate_json(sys.argv[3]))\n"
        "print(json.dumps([str(folder), len(calls)]))\n"
    )
    args = [str(tmp_path / "node-tmp"), version.model_dump_json(), config.storage_options.model_dump_json()]
    workers = [
        subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True) for _ in range(4)
    ]
    results = [json.loads(worker.communicate(timeout=120)[0]) for worker in workers]
    assert {folder for folder, _ in results} == {
        str(tmp_path / "node-tmp" / "prefect-raytrain-data" / version.content_hash)
    }
    assert sum(downloads for _, downloads in results) == 1, results


def test_data_dir_is_the_pipelines_only_for_code_with_prepare(tmp_path: Path) -> None:
    """Code without prepare keeps `data_dir` as a setting of its own; code with prepare may not set it (the
    pipeline's local copy goes there), in its defaults or in train_config."""
    from raytrain_driver.preflight import resolve_code

    own = TrainFunc(lambda config: None, metric=Metric("val_loss", False), defaults={"data_dir": "/data/mine"})
    config = small_config(tmp_path, train_code=CODE, train_config='{"data_dir": "/data/other"}')
    assert user_config(config, own)[DATA_DIR_KEY] == "/data/other"
    with pytest.raises(TypeError, match="may not set 'data_dir'"):
        TrainFunc(own.train_func, metric=own.metric, defaults={"data_dir": "/x"}, prepare=write_rows(1))
    (tmp_path / "prepares.py").write_text(
        "from raytrain_tasks.api import Metric, TrainFunc\n"
        "training = TrainFunc(lambda config: None, metric=Metric('val_loss', False),\n"
        "                     prepare=lambda config, folder: None)\n"
    )
    clash = small_config(tmp_path, train_code="prepares:training", register=False, train_config='{"data_dir": "/x"}')
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        patch.syspath_prepend(str(tmp_path))
        with pytest.raises(UserCodeError, match=r"train_config may not set 'data_dir'"):
            resolve_code(clash)


def test_the_line_prepare_returns_on_what_it_wrote_is_shown_with_the_version_and_in_mlflow(tmp_path: Path) -> None:
    """What a user's prepare says it wrote (rows, columns, classes) is on the prepare-data log line and run page
    (``describe()``) and in the MLflow dataset input's profile; a prepare that returns nothing, or not a string, is
    described by its files as before."""
    import json

    from mlflow import MlflowClient

    from raytrain_driver.evaluation import log_dataset_input

    def says(said: Any) -> Any:
        def prepare(config: dict[str, Any], folder: Path) -> Any:
            write_rows(10)(config, folder)
            return said

        return prepare

    config = small_config(tmp_path, train_code=CODE, epochs=1)
    told = prepare_user_data(config, code(says("10 rows, 2 columns\nsecond line ignored")))
    assert told is not None and told.summary == "10 rows, 2 columns"
    assert "10 rows, 2 columns in 2 files" in told.describe() and told.content_hash in told.describe()
    for quiet in (None, ["not", "a", "line"]):
        plain = prepare_user_data(config, code(says(quiet)))
        assert plain is not None and plain.summary == "" and "2 files, " in plain.describe()
    long = prepare_user_data(config, code(says("x" * 500)))
    assert long is not None and len(long.summary) == 200 and long.summary.endswith("...")
    leaky = prepare_user_data(config, code(says("rows from https://reader:hunter2@db.example/rows")))
    assert leaky is not None and "hunter2" not in leaky.summary and "db.example/rows" in leaky.summary

    client = MlflowClient(config.mlflow_tracking_uri)
    run = client.create_run(client.create_experiment("inputs"))
    log_dataset_input(client, run.info.run_id, told)
    (used,) = client.get_run(run.info.run_id).inputs.dataset_inputs
    assert json.loads(used.dataset.profile) == {"summary": "10 rows, 2 columns"}
    assert told.content_hash.startswith(used.dataset.digest)


def test_code_without_prepare_gets_the_same_storage_check_before_the_fit(s3_server: LocalS3, tmp_path: Path) -> None:
    """prepare-data checks the run's storage for every code, with or without ``prepare``: a folder that cannot be
    written or a missing bucket fails there, in seconds and once (prepare-data has no retries), naming the setting
    to change, before the fit takes its lease or starts a worker; ``create_bucket`` creates the bucket there."""
    from tasks.data import prepare_data

    in_the_way = tmp_path / "a-file"  # a folder the run cannot write, even as root (which ignores permission bits)
    in_the_way.write_text("")
    unwritable = small_config(tmp_path, train_code=CODE, epochs=1, storage_path=str(in_the_way / "storage"))
    with pytest.raises(StorageError, match=r"a-file/storage is not writable .*set `storage_path`"):
        prepare_user_data(unwritable, code(None))

    def on_bucket(create_bucket: bool) -> Any:
        return small_config(
            tmp_path,
            train_code=CODE,
            epochs=1,
            storage_path="s3://prt-no-prepare/runs",
            s3_endpoint_url=s3_server.endpoint_url,
            create_bucket=create_bucket,
        )

    with pytest.raises(StorageError, match=r"bucket 'prt-no-prepare' does not exist.*`create_bucket`.*`storage_path`"):
        prepare_user_data(on_bucket(create_bucket=False), code(None))
    assert prepare_user_data(on_bucket(create_bucket=True), code(None)) is None  # no prepare: nothing stored
    s3_client(on_bucket(create_bucket=True).storage_options).head_bucket(Bucket="prt-no-prepare")  # created
    assert prepare_data.retries == 0  # a storage error found there ends the run at once
