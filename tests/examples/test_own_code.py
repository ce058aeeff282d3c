"""Your own training code through the whole pipeline (`train_code`): Ray Train's own train_func, unchanged,
gets per-epoch MLflow metrics, checkpoints in the run's storage, a resume in the same MLflow run after a worker
is killed, and a registry whose gate compares the code's own metric in its direction.

The examples under examples/ are the acceptance tests: each runs here as a user runs it.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow import MlflowClient

from flows.training import training_pipeline
from raytrain_tasks.api import Metric, TrainFunc
from raytrain_tasks.config import TrainingConfig, parameters_of
from raytrain_tasks.errors import DataRefusedError, TrackingError, UserCodeError
from raytrain_tasks.prepared import PreparedData
from raytrain_tasks.user_code import resolve
from tests.helpers import mlflow_client, only_run, run_killing_a_worker, small_config, start_flow

SEED_DDP = "examples.seed_ddp.train:training"
DIABETES = "examples.diabetes_regression.train:training"
SEED_RAY_DATA = "examples.seed_ray_data.train:training"


# --- resolving train_code: which part failed, said before anything starts -------------------------------------


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, name: str = "my_code") -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize(
    ("source", "code", "says"),
    [
        ("", "no_such_module:training", "no module named 'no_such_module'"),
        ("x = 1\n", "my_cod:training", r"no module named 'my_cod' on this driver \(did you mean 'my_code'\?\)"),
        ("x = 1\n", "my_code.train:training", "'my_code' .* is a module, not a package: it has no module 'train'"),
        ("x = 1\n", "my_code:training", "has no attribute 'training'"),
        ("def training(config):\n    pass\n", "my_code:training", "wrap it as TrainFunc"),
        ("training = 'a string'\n", "my_code:training", "is a str"),
        ("import not_installed_dependency\n", "my_code:training", "No module named 'not_installed_dependency'"),
        ("raise RuntimeError('broken at import')\n", "my_code:training", "RuntimeError: broken at import"),
    ],
    ids=[
        "no module",
        "a misspelt module",
        "a module under a module",
        "no attribute",
        "a plain function",
        "wrong kind",
        "a missing dependency",
        "import fails",
    ],
)
def test_train_code_that_cannot_be_used_is_named_with_the_part_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, code: str, says: str
) -> None:
    name = _module(tmp_path, monkeypatch, source, name=f"my_code_{abs(hash(source)) % 10_000}")
    code, says = code.replace("my_code", name), says.replace("my_code", name)
    with pytest.raises(UserCodeError) as raised:
        resolve(code)
    assert code in str(raised.value) and re.search(says, str(raised.value)), str(raised.value)


def test_a_train_func_spec_is_checked_when_it_is_made() -> None:
    with pytest.raises(TypeError, match="Metric"):
        TrainFunc(lambda config: None, metric="val_loss")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="together"):
        TrainFunc(lambda config: None, metric=Metric("val_loss", False), load_model=lambda path, config: None)
    assert not TrainFunc(lambda config: None, metric=Metric("loss", False)).can_register
    # A default for a key the pipeline always sets would never apply (defaults={"lr": 0.1} trained at 0.003).
    with pytest.raises(TypeError, match=r"TrainFunc\(defaults=...\) may not set lr: .*`learning_rate`"):
        TrainFunc(lambda config: None, metric=Metric("loss", False), defaults={"lr": 0.1, "hidden": 8})


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"train_code": "examples seed"}, "package.module:attribute"),
        ({"train_config": "{not json"}, "not valid JSON"),
        ({"train_config": "[1, 2]"}, "JSON object"),
        # The pipeline's own settings reach the code as config["epochs"] and so on: set there, they would train
        # other epochs than the run's MLflow param, its progress and its resume say.
        ({"train_config": '{"epochs": 20, "hidden": 8}'}, r"may not set epochs: .*`epochs` \(--epochs\)"),
        ({"train_config": '{"lr": 0.1}'}, r"may not set lr: .*`learning_rate` \(--learning-rate\)"),
        ({"train_config": {"seed": 1}}, r"may not set seed: .*`seed` \(--seed\)"),
        # MLflow's limits on a param: its value (6000 characters), its name.
        ({"train_config": {"hidden": "x" * 6000}}, "more than the 6000 of an MLflow param"),
        ({"train_config": {"hidden@2": 1}}, "cannot be the MLflow param 'train_config.hidden@2'"),
    ],
)
def test_bad_training_code_settings_are_refused_naming_the_setting(settings: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        TrainingConfig(**settings)


def test_train_config_is_logged_as_params_one_per_key() -> None:
    config = TrainingConfig(train_code=SEED_DDP, train_config='{"hidden": 64, "layers": [2, 3]}')
    params = config.public_params(secret_keys=())
    assert params["train_config.hidden"] == 64 and params["train_config.layers"] == "[2, 3]"
    # One canonical text whatever the order, spacing or form (text or object): a resume compares it.
    assert params["train_config"] == '{"hidden":64,"layers":[2,3]}'
    for same in ('{"layers":[2,3],"hidden":64}', {"layers": [2, 3], "hidden": 64}):
        assert TrainingConfig(train_config=same).public_params(secret_keys=())["train_config"] == params["train_config"]


def test_an_own_code_runs_params_are_what_trained_it() -> None:
    """The MLflow params of a run of your code: its defaults where train_config leaves them, none of the built-in
    classifier's settings (a regression run does not claim to be gated on val_accuracy); a resume with other
    defaults is refused, naming the key."""
    from raytrain_tasks.code_settings import code_values
    from raytrain_tasks.tracking.runs import _check_params_unchanged

    def with_defaults(**defaults: object) -> dict[str, object]:
        spec = TrainFunc(lambda config: None, metric=Metric("rmse", higher_is_better=False), defaults=defaults)
        return code_values(spec, config.train_config, DIABETES)

    config = TrainingConfig(train_code=DIABETES, train_config='{"hidden": 64}')
    params = config.public_params(with_defaults(hidden=32, dropout=0.1), secret_keys=())
    assert params["train_config.hidden"] == 64 and params["train_config.dropout"] == 0.1
    assert not {"dataset", "model", "hidden_sizes", "promotion_metric", "data_loader"} & set(params), params
    # Whatever a default holds: a Path is its text, a URL's password is masked, a long value is cut to MLflow's limit.
    odd = config.public_params(
        {"root": Path("/data/x"), "src": "https://u:pw-in-default@h/x", "names": ["a"] * 5000}, secret_keys=()
    )
    assert odd["train_config.root"] == '"/data/x"' and "pw-in-default" not in odd["train_config.src"]
    assert len(odd["train_config.names"]) <= 6000 and odd["train_config.names"].endswith("...(cut)")
    logged = {key: str(value) for key, value in params.items()}
    with pytest.raises(TrackingError, match=r"train_config.dropout: '0.1' -> '0.2'"):
        _check_params_unchanged(
            logged,
            config.public_params(with_defaults(hidden=32, dropout=0.2), secret_keys=()),
            "20260101-000000-abcdef",
        )


# --- end to end, on a real local Ray, the Prefect test harness and MLflow on SQLite ----------------------------


def own_config(workdir: Path, code: str, **overrides: Any) -> TrainingConfig:
    return small_config(
        workdir, train_code=code, **{"epochs": 4, "register": False, "train_config": '{"hidden": 32}', **overrides}
    )


@pytest.fixture(scope="module")
def seed_reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted run of the seed-shaped example every recovered run must match."""
    return training_pipeline(**parameters_of(own_config(tmp_path_factory.mktemp("seed-reference"), SEED_DDP)))


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_a_seed_shaped_train_func_survives_a_killed_worker_in_one_mlflow_run(
    tmp_path: Path, seed_reference: Any
) -> None:
    state, kill = run_killing_a_worker(tmp_path, own_config(tmp_path, SEED_DDP), after_epoch=1)
    assert state.is_completed(), state
    run = only_run(tmp_path)
    assert run is not None and run.info.status == "FINISHED"
    client = mlflow_client(tmp_path)
    expected = {int(entry["epoch"]) + 1: entry for entry in seed_reference.fit.history}
    for key in ("val_loss", "val_accuracy"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == [1, 2, 3, 4], f"{key}: every epoch exactly once"
        for metric in history:
            assert metric.value == pytest.approx(expected[metric.step][key], abs=1e-6), (key, metric.step)
    assert kill.resume_epoch >= 1
    # The train_config and the code are on the run, as params and tags; every checkpoint is pinned by digest.
    assert run.data.params["train_code"] == SEED_DDP and run.data.params["train_config.hidden"] == "32"
    pins = [key for key in run.data.tags if key.startswith("prefect_raytrain.checkpoint_sha256.")]
    assert len(pins) >= 4, sorted(run.data.tags)
    # The learning curves of what the function reported, which the run page links, and where its best checkpoint is.
    assert {"evaluation/learning_curves.png", "evaluation/checkpoint.json"} <= {
        a.path for a in client.list_artifacts(run.info.run_id, "evaluation")
    }
    pointer = json.loads(Path(client.download_artifacts(run.info.run_id, "evaluation/checkpoint.json")).read_text())
    assert pointer["run_key"] == run.data.tags["prefect_raytrain.run_key"] and pointer["epoch"] in (1, 2, 3, 4)
    assert pointer["uri"].startswith(pointer["run_uri"])


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_a_checkpoint_changed_before_a_restart_inside_the_fit_is_not_handed_to_the_restarted_workers(
    tmp_path: Path,
) -> None:
    """Someone with write access to storage replaces the weights in the checkpoints of a running fit (valid files:
    the function's own `torch.load(weights_only=True)` takes them), then a worker is lost. The restarted group is
    not given the changed checkpoint: the fit stops with CheckpointError naming storage_path, is not retried, and
    the MLflow run is FAILED. Before, the run went on from the replaced weights and finished."""
    import torch

    from examples.seed_ddp.train import CHECKPOINT_FILE
    from raytrain_tasks.errors import CheckpointError

    def replace_the_weights(epoch: int) -> None:
        (run_dir,) = (tmp_path / "storage" / "runs").iterdir()
        # The committed ones: their digests are pinned in MLflow when the driver commits them, which can come after
        # the workers stopped (this function's epochs take milliseconds: epochs 2 and 3 were uploaded while epoch 1
        # was being committed). One replaced before its pin would be pinned as replaced, and rightly handed over.
        pinned = _pinned_once_quiet(tmp_path)
        folders = sorted(path for path in run_dir.glob("checkpoint_*") if path.is_dir() and path.name in pinned)
        assert folders, (sorted(run_dir.iterdir()), pinned)
        for folder in folders:
            state = torch.load(folder / CHECKPOINT_FILE, weights_only=True)
            state["model"] = {key: torch.zeros_like(value) for key, value in state["model"].items()}
            torch.save(state, folder / CHECKPOINT_FILE)

    config = own_config(tmp_path, SEED_DDP, max_failures=1, fit_retries=2)
    state, _ = run_killing_a_worker(tmp_path, config, before_kill=replace_the_weights)
    assert state.is_failed(), state
    error = state.result(raise_on_failure=False)
    assert isinstance(error, CheckpointError), error
    assert "no longer hash" in str(error) and "storage_path" in str(error), error
    run = only_run(tmp_path)
    assert run.info.status == "FAILED" and "CheckpointError" in run.data.tags["prefect_raytrain.error"], run.data.tags


def _pinned_once_quiet(workdir: Path, quiet_s: float = 1.0) -> frozenset[str]:
    """The checkpoint folders pinned in the run's MLflow tags, once no new pin has come for ``quiet_s`` seconds."""
    from raytrain_tasks.tracking.names import pinned_digests

    seen, since = frozenset[str](), time.monotonic()
    while True:
        now = frozenset(pinned_digests(only_run(workdir).data.tags))
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return seen
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_a_ray_data_train_func_reads_its_shards_survives_a_killed_worker_and_registers(tmp_path: Path) -> None:
    """examples/seed_ray_data, the seeds' `train_ray_ddp_with_ray_data.py` shape: `TrainFunc(datasets=...)`
    reaches `TorchTrainer(datasets=...)`, each worker reads `get_dataset_shard`, a killed worker resumes through the
    function's own `get_checkpoint()` in the same MLflow run, and the model registered from its checkpoint predicts."""
    import mlflow
    import numpy as np

    result = _finished_in_one_run_despite_a_killed_worker(tmp_path, own_config(tmp_path, SEED_RAY_DATA, register=True))
    assert result.model is not None and result.model.aliases == ("champion",), result.model
    assert result.fit.scores["val_rmse"] < 1.0  # below the spread of the standardised target: it learned
    with _tracking(tmp_path):
        predicted = mlflow.pyfunc.load_model("models:/digits-test@champion").predict(np.zeros((3, 10), np.float32))
    assert np.asarray(predicted).shape == (3, 1)


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_a_train_spec_on_ray_datasets_streams_shards_survives_a_killed_worker_and_is_gated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TrainSpec whose splits are Ray Datasets (data too large for every worker to load): built on the driver,
    `train` sharded across the workers, `val` and `test` scored exactly over the whole split; a killed worker
    resumes in the same MLflow run; the second run's gate scores the champion on today's test split through Ray
    Data on the driver."""
    callers = tmp_path / "data_called_by.txt"
    source = """
        import os
        import numpy as np, ray.data, torch
        from raytrain_tasks.api import Metric, Splits, TrainSpec

        def rows(count, end):  # y = 3x on [-end, end]
            x = np.linspace(-end, end, count, dtype=np.float32).reshape(-1, 1)
            return ray.data.from_items([{"x": value, "y": 3 * value} for value in x])

        def data(config):
            with open(CALLERS, "a") as out:
                out.write(f"{os.getpid()}\\n")
            return Splits(rows(1024, 1.0), rows(160, 0.99), rows(80, 0.98), columns=("x", "y"))

        def model(config, example):  # BatchNorm: buffers a DDP forward would sync
            return torch.nn.Sequential(torch.nn.BatchNorm1d(example.shape[1], momentum=None),
                                       torch.nn.Linear(example.shape[1], 1))

        training = TrainSpec(data=data, model=model, loss=torch.nn.functional.mse_loss,
                             metrics=lambda outputs, targets: {"mae": (outputs - targets).abs().mean()},
                             metric=Metric("loss", higher_is_better=False),
                             optimizer=lambda parameters, config: torch.optim.SGD(parameters, lr=0.1))
    """
    source = source.replace("CALLERS", repr(str(callers)))
    code = f"{_module(tmp_path, monkeypatch, source, name='ray_data_spec')}:training"
    # Each worker trains 4 batches of 128 an epoch. The 80 test rows are one batch: the second worker scores none,
    # yet reduces the same metrics as the first. The 160 val rows are two: each worker scores one, with rank 0's
    # BatchNorm statistics (those of the checkpoint), not its own.
    config = own_config(tmp_path, code, register=True, batch_size=128)
    first = _finished_in_one_run_despite_a_killed_worker(tmp_path, config, "val_loss")
    assert first.model is not None and first.model.aliases == ("champion",), first.model
    # Only the driver builds the splits (its check, the fit, the registration): no worker, not even the restarted
    # ones, so a data() that materializes its splits reads them once per fit, not once more per worker.
    assert set(callers.read_text().split()) == {str(os.getpid())}, callers.read_text()
    assert first.fit.scores["test_loss"] < 0.1 and first.fit.best_metrics["val_mae"] < 0.3, first.fit  # y = 3x
    # The run says how its workers read: Ray Data
    tags = only_run(tmp_path).data.tags
    assert (
        tags["prefect_raytrain.data_loader"] == "ray_data" and "data loader `ray_data`" in tags["mlflow.note.content"]
    )
    # Exact over the whole split: val_loss as the workers reported it (each scored a share of the batches, the
    # sums all-reduced) is the loss of the registered (best) checkpoint's model over all 160 validation rows.
    import mlflow
    import numpy as np
    import torch

    with _tracking(tmp_path):
        model = mlflow.pytorch.load_model(f"models:/digits-test/{first.model.version}")
    x = torch.from_numpy(np.linspace(-0.99, 0.99, 160, dtype=np.float32).reshape(-1, 1))
    with torch.no_grad():
        assert first.fit.best_metrics["val_loss"] == pytest.approx(float(((model(x) - 3 * x) ** 2).mean()), rel=1e-4)
    second = training_pipeline(**parameters_of(own_config(tmp_path, code, epochs=2, register=True, batch_size=128)))
    assert second.model is not None
    tags = mlflow_client(tmp_path).get_model_version("digits-test", second.model.version).tags
    assert float(tags["promotion.champion_score"]) < 0.1, tags  # the champion, scored on the driver


def _finished_in_one_run_despite_a_killed_worker(tmp_path: Path, config: Any, metric: str = "val_rmse") -> Any:
    """The flow's result, once a worker SIGKILLed after epoch 1 was recovered from: one FINISHED MLflow run, every
    epoch's ``metric`` logged exactly once."""
    state, kill = run_killing_a_worker(tmp_path, config, after_epoch=1, metric=metric)
    assert state.is_completed(), state
    run = only_run(tmp_path)
    assert run is not None and run.info.status == "FINISHED"
    history = mlflow_client(tmp_path).get_metric_history(run.info.run_id, metric)
    assert sorted(m.step for m in history) == [1, 2, 3, 4], "every epoch exactly once"
    assert kill.resume_epoch >= 1
    return state.result()


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_the_diabetes_example_trains_a_champion_that_predicts_with_its_checkpoints_sorted_by_rmse(
    tmp_path: Path,
) -> None:
    """examples/diabetes_regression as a user runs it: RMSE, lower is better. Its run takes `champion`, its kept
    checkpoints are models sorted by val_rmse, and the registered model loads and predicts. (A worse run staying
    challenger is shown on the TrainSpec runs below, whose gate compares test_mae, also lower-is-better.)"""
    import mlflow
    import numpy as np

    good = training_pipeline(**parameters_of(own_config(tmp_path, DIABETES, register=True)))
    assert good.model is not None and good.model.aliases == ("champion",), good.model
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert str(client.get_registered_model("digits-test").aliases["champion"]) == good.model.version
    _kept_checkpoints_are_models_sorted_by_the_metric(client, good, "val_rmse", higher_is_better=False)
    with _tracking(tmp_path):
        predicted = mlflow.pyfunc.load_model("models:/digits-test@champion").predict(np.zeros((3, 10), np.float32))
    assert np.asarray(predicted).shape == (3, 1)


def _kept_checkpoints_are_models_sorted_by_the_metric(
    client: MlflowClient, result: Any, metric: str, *, higher_is_better: bool
) -> None:
    """Your code's kept checkpoints are LoggedModels in the Models tab as the built-in's are: one per checkpoint
    folder, its report's metrics linked at its step, so the best checkpoint is a sort on your metric in its
    direction; the registered version's model names the checkpoint model it was made from."""
    fit = result.fit
    models = client.search_logged_models(
        [fit.mlflow_experiment_id],
        filter_string=f"source_run_id = '{fit.mlflow_run_id}'",
        order_by=[{"field_name": f"metrics.{metric}", "ascending": not higher_is_better}],
    )
    checkpoints = [m for m in models if m.model_type == "checkpoint"]
    run_dir = Path(fit.run_uri)
    folders = sorted(p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith(("checkpoint_", "epoch-")))
    where = sorted(Path(m.tags["prefect_raytrain.checkpoint_uri"]).name for m in checkpoints)
    assert folders and where == folders, (folders, where)
    history = {m.step: m.value for m in client.get_metric_history(fit.mlflow_run_id, metric)}
    for model in checkpoints:
        linked = {m.key: m for m in model.metrics}
        step = int(model.tags["prefect_raytrain.epoch"])
        assert linked[metric].step == step and linked[metric].value == history[step], model.name
        assert model.name == Path(model.tags["prefect_raytrain.checkpoint_uri"]).name.replace(".", "-")
    value = {m.model_id: next(x.value for x in m.metrics if x.key == metric) for m in checkpoints}
    first = [m.model_id for m in checkpoints if value[m.model_id] == value[checkpoints[0].model_id]]  # ties
    assert fit.best_checkpoint_model_id in first, "the sort's first is the fit's best"
    version = client.get_model_version(result.model.name, result.model.version)
    registered = client.get_logged_model(version.source.removeprefix("models:/"))
    assert registered.tags["prefect_raytrain.checkpoint_model_id"] == fit.best_checkpoint_model_id
    # Linking re-logged the run's own points: each step is still in the run once.
    assert len(client.get_metric_history(fit.mlflow_run_id, metric)) == len(history)


# --- one TrainSpec with prepare, a typed setting choosing its metric, registered twice -------------------------

CHOSEN_METRIC = """
    from pathlib import Path
    from typing import Literal
    import torch
    from pydantic import BaseModel
    from torch.utils.data import Subset, TensorDataset
    from raytrain_tasks.api import Metric, Splits, TrainSpec

    class Settings(BaseModel):
        select_by: Literal["loss", "mae"] = "loss"
        source: str = ""
        slope: float = 2.0

    def prepare(config, folder):
        (folder / "rows.csv").write_text(Path(config["source"]).read_text())

    def data(config):  # y = slope * x on the prepared rows: the slope is the data of the day
        values = [float(v) for v in (Path(config["data_dir"]) / "rows.csv").read_text().split()]
        x = torch.tensor(values).unsqueeze(1)
        rows = TensorDataset(x, config["slope"] * x)
        return Splits(*(Subset(rows, range(start, len(rows), 3)) for start in range(3)))

    training = TrainSpec(data=data, prepare=prepare, model=lambda config, example: torch.nn.Linear(1, 1),
                         loss=torch.nn.functional.mse_loss,
                         metrics=lambda outputs, targets: {"mae": (outputs - targets).abs().mean()},
                         metric=lambda config: Metric(config["select_by"], higher_is_better=False),
                         settings=Settings,
                         optimizer=lambda parameters, config: torch.optim.SGD(parameters, lr=config["lr"]),
                         model_metadata=lambda config: {"output": "slope*x", "chosen_by": config["select_by"]})
"""


@pytest.fixture(scope="module")
def spec_registry(tmp_path_factory: pytest.TempPathFactory, ray_cluster: Any, prefect_api: Any) -> SimpleNamespace:
    """One workdir, one registry, one TrainSpec with `prepare` (its data versioned by content) whose typed setting
    picks the metric: a setting its class refuses; a good run on y = 2x (champion); a resume after the prepared
    source grew (refused); a run on the data of another day, y = 2.5x, that barely learns (challenger)."""
    workdir = tmp_path_factory.mktemp("spec-registry")
    (workdir / "code").mkdir()
    rows = workdir / "rows.txt"
    rows.write_text("\n".join(str(i / 30) for i in range(-30, 30)))
    with pytest.MonkeyPatch.context() as monkeypatch:
        code = f"{_module(workdir / 'code', monkeypatch, CHOSEN_METRIC, name='chosen_metric_prepared')}:training"

        def config(**overrides: Any) -> TrainingConfig:
            # lr 0.5 on batches of 4: the bias settles at once, the slope within the 9 steps of 3 epochs
            settings = {"epochs": 3, "batch_size": 4, "register": True, "learning_rate": 0.5, **overrides}
            return own_config(workdir, code, **settings)

        runs = SimpleNamespace(workdir=workdir, code=code, rows=rows)
        runs.refused_setting = training_pipeline(
            **parameters_of(config(train_config={"select_by": "f1", "source": str(rows)})), return_state=True
        )
        runs.mlflow_runs_after_refusal = only_run(workdir)
        mae_of = {"select_by": "mae", "source": str(rows)}
        runs.first = training_pipeline(**parameters_of(config(train_config=mae_of)))
        rows.write_text("\n".join(str(i / 30) for i in range(-30, 31)))  # the source grew
        runs.grown_resume = training_pipeline(
            **parameters_of(config(train_config=mae_of, resume=runs.first.run_key)), return_state=True
        )
        runs.first_status_after_resume = mlflow_client(workdir).get_run(runs.first.fit.mlflow_run_id).info.status
        runs.second = training_pipeline(
            **parameters_of(config(epochs=1, learning_rate=1e-6, train_config={**mae_of, "slope": 2.5}))
        )
    return runs


@pytest.mark.slow
def test_a_setting_of_the_code_chooses_the_metric_that_picks_the_checkpoint_and_gates(
    spec_registry: SimpleNamespace,
) -> None:
    """`metric=` as a function of config, chosen by a typed setting (as the built-in's promotion_metric is): the run
    picks its best checkpoint by val_mae, the registered version is gated on test_mae; a choice the settings class
    does not allow is refused before anything starts."""
    refused, workdir, result = spec_registry.refused_setting, spec_registry.workdir, spec_registry.first
    assert refused.is_failed(), refused
    error = refused.result(raise_on_failure=False)
    assert isinstance(error, UserCodeError), repr(error)
    assert re.search(r"train_config.select_by: Input should be 'loss' or 'mae'", str(error)), str(error)
    assert spec_registry.mlflow_runs_after_refusal is None
    assert result.model is not None and set(result.fit.scores) == {"val_mae", "val_loss", "test_mae", "test_loss"}
    client = mlflow_client(workdir)
    run = client.get_run(result.fit.mlflow_run_id)
    assert run.data.tags["summary.best_val_mae"] and run.data.params["train_config.select_by"] == "mae"
    # The run's summary, as the built-in's: the final value of every reported metric, and the table of best and final
    assert {"summary.final_val_mae", "summary.final_val_loss", "summary.final_train_loss"} <= set(run.data.tags)
    table = run.data.tags["mlflow.note.content"].split("#### Result", 1)[1]
    assert "| epoch | val_mae | train_loss | val_loss |\n" in table and "best by val_mae:" in table, table  # no timing
    version = client.get_model_version("digits-test", result.model.version)
    assert version.tags["gate.metric"] == "test_mae", version.tags
    # The version's description names what picked its checkpoint (it named the gate's metric, test_mae, before)
    assert "by val_mae;" in version.description, version.description
    with _tracking(workdir):  # the code's model_metadata beside the pipeline's own keys
        import mlflow

        metadata = mlflow.models.get_model_info(f"models:/digits-test/{result.model.version}").metadata
    assert metadata["output"] == "slope*x" and metadata["chosen_by"] == "mae", metadata
    assert metadata["run_key"] == result.run_key and metadata["train_code"] == spec_registry.code, metadata
    _kept_checkpoints_are_models_sorted_by_the_metric(client, result, "val_mae", higher_is_better=False)
    # As the built-in classifier's runs show them: the learning curves the run page links, and each epoch how fast
    # the whole group trained and on how many workers.
    assert "evaluation/learning_curves.png" in [a.path for a in client.list_artifacts(run.info.run_id, "evaluation")]
    for key, plausible in (("samples_per_second", lambda value: value > 0), ("workers", lambda value: value == 2)):
        points = client.get_metric_history(run.info.run_id, key)
        assert sorted(p.step for p in points) == [1, 2, 3] and all(plausible(p.value) for p in points), (key, points)
    # The best checkpoint's held-out scores on the run, at its step, as the built-in classifier's.
    best = client.get_metric_history(run.info.run_id, "best_checkpoint_val_mae")
    assert [(p.step, p.value) for p in best] == [(result.fit.best_epoch, result.fit.best_metrics["val_mae"])], best


@pytest.mark.slow
def test_prepared_data_is_versioned_read_by_every_worker_and_pinned_to_its_run(spec_registry: SimpleNamespace) -> None:
    """A TrainSpec with prepare: prepare-data stores what it writes under its content hash, the workers and the
    driver's registration read it from config["data_dir"], the MLflow run and the registered version name that
    hash, and a resume after the source changed is refused (the run continues only on the data it started on)."""
    first, workdir = spec_registry.first, spec_registry.workdir
    assert isinstance(first.dataset, PreparedData) and first.model is not None
    stored = workdir / "storage" / "datasets" / first.dataset.content_hash / "files" / "rows.csv"
    assert stored.read_text() == "\n".join(str(i / 30) for i in range(-30, 30))  # the source as it was then
    client = mlflow_client(workdir)
    run = client.get_run(first.fit.mlflow_run_id)
    assert run.data.tags["prefect_raytrain.dataset_hash"] == first.dataset.content_hash
    # The MLflow UI's lineage: the stored version is the run's training input, named by its content.
    (used,) = run.inputs.dataset_inputs
    assert first.dataset.content_hash.startswith(used.dataset.digest) and used.dataset.name.endswith(
        first.dataset.content_hash
    )
    assert json.loads(used.dataset.source)["uri"] == first.dataset.uri
    assert client.get_model_version("digits-test", first.model.version).tags["dataset_hash"] == (
        first.dataset.content_hash
    )

    refused = spec_registry.grown_resume  # the source grew, then the run was resumed
    assert refused.is_failed(), refused
    error = str(refused.result(raise_on_failure=False))
    assert re.search(r"was trained on dataset .*but its data is dataset", error), error
    assert first.dataset.content_hash in error
    assert spec_registry.first_status_after_resume == "FINISHED"  # the run it refused is untouched


@pytest.mark.slow
def test_a_train_spec_champion_is_scored_again_on_the_data_of_today_and_a_worse_run_stays_challenger(
    spec_registry: SimpleNamespace,
) -> None:
    """Two runs of one TrainSpec whose data changed in between (y = 2x, then y = 2.5x, chosen by train_config): the
    second run's gate scores the champion on today's test split (what loading it from the registry and scoring
    those rows gives), not by the test_mae it recorded on its own data. The second run, which barely trained, does
    not beat it there (lower is better): it is registered as `challenger` and the champion stays."""
    import mlflow
    import torch

    first, second, workdir = spec_registry.first, spec_registry.second, spec_registry.workdir
    assert first.model is not None and first.model.aliases == ("champion",), first.model
    assert second.model is not None
    values = [float(v) for v in spec_registry.rows.read_text().split()]  # the second run's source
    x = torch.tensor(values).unsqueeze(1)[2::3]
    with _tracking(workdir):
        champion = mlflow.pytorch.load_model(f"models:/digits-test/{first.model.version}")
    with torch.no_grad():
        today = float((champion(x) - 2.5 * x).abs().mean())
    client = mlflow_client(workdir)
    tags = client.get_model_version("digits-test", second.model.version).tags
    assert float(tags["promotion.champion_score"]) == pytest.approx(today, rel=1e-4), tags
    recorded = first.fit.scores["test_mae"]
    assert abs(today - recorded) > 0.1, (today, recorded)  # scored again, on other rows than it was trained for
    assert second.fit.scores["test_mae"] > today and second.fit.scores["val_mae"] > first.fit.scores["val_mae"]
    assert second.model.aliases == ("challenger",), second.model
    assert "does not beat champion" in second.model.reason
    assert str(client.get_registered_model("digits-test").aliases["champion"]) == first.model.version


def _tracking(workdir: Path) -> Any:
    from raytrain_tasks.tracking.runs import using_tracking_uri

    return using_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_user_code_outside_the_project_that_never_reports_the_gate_metric_fails_once_and_registers_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The code lives in a folder of its own (the command's working directory), reaches the workers from there,
    trains and checkpoints, but reports `loss` while its TrainFunc gates on `val_score`. Ray Train would keep its
    checkpoints by a metric they lack, so the first checkpointed report is refused on the worker: the
    run fails there, once (a UserCodeError, not retried by the controller or by Prefect), saying how to continue
    with `resume=<run key>`, and nothing is committed or registered."""
    starts = tmp_path / "starts.txt"
    source = f"""
        import tempfile, torch, ray.train
        from raytrain_tasks.api import Metric, TrainFunc

        def train_func(config):
            with open({str(starts)!r}, "a") as out:
                out.write("start\\n")
            for epoch in range(config["epochs"]):
                with tempfile.TemporaryDirectory() as folder:
                    torch.save({{"epoch": epoch}}, f"{{folder}}/state.pt")
                    ray.train.report({{"epoch": epoch, "loss": 1.0 / (epoch + 1)}},
                                     checkpoint=ray.train.Checkpoint.from_directory(folder))

        training = TrainFunc(train_func, metric=Metric("val_score", higher_is_better=True),
                             load_model=lambda path, config: torch.nn.Linear(1, 1),
                             input_example=lambda config: torch.zeros(1, 1))
    """
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    name = _module(elsewhere, monkeypatch, source)
    config = own_config(tmp_path, f"{name}:training", epochs=2, register=True, max_failures=2, fit_retries=2)
    with ThreadPoolExecutor(1) as pool:
        state = start_flow(pool, config).result(timeout=600)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, UserCodeError) and "val_score" in str(error), repr(error)
    assert "start a new run" in str(error) and "resume=" in str(error), error  # which fix a resume can take
    run = only_run(tmp_path)
    assert run is not None and run.info.status == "FAILED"
    assert client_versions(tmp_path) == []
    assert starts.read_text().count("start") == 2, starts.read_text()  # once per worker: no Prefect retry
    assert f"`resume={run.data.tags['prefect_raytrain.run_key']}`" in str(error), error
    said = [record.getMessage() for record in caplog.records]
    assert not [line for line in said if line.startswith("epoch 1/2 committed")], said  # refused before Ray took it


def client_versions(workdir: Path) -> list[Any]:
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    return list(client.search_model_versions("name = 'digits-test'"))


# --- one TrainSpec run stopped by its own code, resumed three times --------------------------------------------

STOPPED_AND_RESUMED = """
    import os
    import numpy as np, torch
    from torch.utils.data import TensorDataset
    from raytrain_tasks.api import Metric, Splits, TrainSpec

    training_batches, stop_marker = 0, ""

    def data(config):  # called on every worker too: where the test's marker is
        global stop_marker
        stop_marker = config["stop_marker"]
        with open(config["starts"], "a") as out:
            out.write("start\\n")
        x = torch.from_numpy(np.load(config["data_file"])).unsqueeze(1)
        rows = TensorDataset(x, 3 * x)
        return Splits(rows, rows, rows)

    def loss_of_my_own(outputs, targets):
        global training_batches
        training_batches += torch.is_grad_enabled()  # training (not scoring): 2 batches an epoch on each worker
        if training_batches > 4 and os.path.exists(stop_marker):  # epoch 3, while the test's marker is there
            raise TypeError("unsupported operand in epoch 3: my_layer(x) got a list")
        return torch.nn.functional.mse_loss(outputs, targets)

    training = TrainSpec(data=data, model=lambda config, example: torch.nn.Linear(1, 1), loss=loss_of_my_own,
                         metric=Metric("loss", higher_is_better=False),
                         defaults={"data_file": "", "stop_marker": "", "starts": ""})
"""


def _folders(run_dir: Path) -> list[str]:
    return sorted(path.name for path in run_dir.iterdir() if path.is_dir())


def _logged_steps(workdir: Path, run_id: str) -> list[int]:
    return sorted(m.step for m in mlflow_client(workdir).get_metric_history(run_id, "val_loss"))


@pytest.fixture(scope="module")
def resumed_spec(tmp_path_factory: pytest.TempPathFactory, ray_cluster: Any, prefect_api: Any) -> SimpleNamespace:
    """One run of a TrainSpec without `prepare` (pinned by the content hash of its splits), each step as a user
    meets it, with what the test reads taken as each step ends:
    1. a TypeError of the code in epoch 3 stops it (epochs 1 and 2 checkpointed);
    2. resumed after its data file changed: refused by the workers;
    3. the data put back and epoch 2's checkpoint tampered with: resumed, epoch 2 retrained, finished;
    4. Ray Train's checkpoint snapshot pointed at a copy of epoch 1 under another name: the resume is refused."""
    import shutil

    import numpy as np

    workdir = tmp_path_factory.mktemp("resumed-spec")
    data_file, marker, starts = workdir / "rows.npy", workdir / "stop", workdir / "starts.txt"
    np.save(data_file, np.linspace(-1, 1, 64, dtype=np.float32))
    marker.touch()
    steps = SimpleNamespace(workdir=workdir)
    with pytest.MonkeyPatch.context() as monkeypatch:
        code = f"{_module(workdir, monkeypatch, STOPPED_AND_RESUMED, name='stopped_and_resumed')}:training"
        train_config = {"data_file": str(data_file), "stop_marker": str(marker), "starts": str(starts)}

        def run(**overrides: Any) -> Any:
            settings = {"epochs": 3, "batch_size": 16, "max_failures": 2, "fit_retries": 2, "checkpoints_to_keep": 10}
            config = own_config(workdir, code, train_config=train_config, **{**settings, **overrides})
            with ThreadPoolExecutor(1) as pool:
                return start_flow(pool, config).result(timeout=600)

        steps.stopped = run(register=True)
        steps.stopped_run = only_run(workdir)
        (run_dir,) = (workdir / "storage" / "runs").iterdir()
        steps.run_dir = run_dir
        steps.stopped_folders = _folders(run_dir)
        steps.stopped_starts = starts.read_text()
        steps.stopped_steps = _logged_steps(workdir, steps.stopped_run.info.run_id)

        np.save(data_file, np.linspace(-2, 2, 64, dtype=np.float32))  # other rows, the same shape
        marker.unlink()
        starts.unlink()
        steps.changed = run(register=True, resume=run_dir.name)
        steps.changed_run = only_run(workdir)
        steps.changed_starts = starts.read_text()
        steps.changed_steps = _logged_steps(workdir, steps.stopped_run.info.run_id)
        steps.changed_versions = client_versions(workdir)

        np.save(data_file, np.linspace(-1, 1, 64, dtype=np.float32))  # the rows it was trained on
        (run_dir / "epoch-0002" / "spec_state.pt").write_bytes(b"tampered")
        steps.retrained = run(resume=run_dir.name)
        steps.retrained_run = only_run(workdir)
        steps.retrained_folders = _folders(run_dir)
        steps.retrained_steps = _logged_steps(workdir, steps.stopped_run.info.run_id)

        # A real checkpoint, of the first epoch, where Ray Train's record says the newest one is.
        shutil.copytree(run_dir / "epoch-0001", run_dir / "planted-0003")
        snapshot = run_dir / "checkpoint_manager_snapshot.json"
        snapshot.write_text(snapshot.read_text().replace("epoch-0003", "planted-0003"))
        (run_dir / "fit.json").unlink()  # as a driver killed between the last epoch and its record leaves the run
        steps.planted = run(register=True, resume=run_dir.name)
        steps.planted_folders = _folders(run_dir)
        steps.planted_steps = _logged_steps(workdir, steps.stopped_run.info.run_id)
        steps.planted_models = mlflow_client(workdir).search_registered_models()
    return steps


@pytest.mark.slow
def test_a_type_error_in_the_users_code_is_not_retried_and_shows_their_frames(resumed_spec: SimpleNamespace) -> None:
    """Every attempt would fail the same way: the fit stops at the first one (one start per worker, not
    `max_failures` + 1 of them, nor Prefect's `fit_retries`), names the error and the user's own function, and
    registers nothing."""
    state = resumed_spec.stopped
    assert state.is_failed(), state
    error = state.result(raise_on_failure=False)
    assert isinstance(error, UserCodeError), repr(error)
    assert "TypeError" in str(error) and "loss_of_my_own" in str(error) and "Not retried" in str(error), str(error)
    # The driver's check of the data, then once per worker: no restart, no Prefect retry.
    assert resumed_spec.stopped_starts.count("start") == 3, resumed_spec.stopped_starts
    assert resumed_spec.stopped_run is not None and resumed_spec.stopped_run.info.status == "FAILED"
    assert client_versions(resumed_spec.workdir) == []


@pytest.mark.slow
def test_a_resume_on_data_that_changed_since_the_last_checkpoint_is_refused_and_trains_nothing(
    resumed_spec: SimpleNamespace,
) -> None:
    """A TrainSpec without ``prepare`` is pinned by the content hash of its splits: a run continued after its
    data changed would mix two datasets in one model and one MLflow run. The resume is refused, naming the
    change and what to do; no epoch is trained or logged again and nothing is registered."""
    logged = resumed_spec.stopped_steps
    assert logged in ([1], [1, 2]), logged  # stopped in epoch 3, after one or two committed checkpoints
    second = resumed_spec.changed
    error = second.result(raise_on_failure=False)
    assert second.is_failed(), second
    assert isinstance(error, DataRefusedError), repr(error)  # a DatasetError, which Prefect does not retry
    assert "the data changed since this run's last checkpoint" in str(error), repr(error)
    assert "Start a new run instead" in str(error), repr(error)
    after = resumed_spec.changed_run  # the same MLflow run, not finished, and no epoch logged again
    assert after.info.run_id == resumed_spec.stopped_run.info.run_id and after.info.status != "FINISHED"
    assert resumed_spec.changed_steps == logged
    assert resumed_spec.changed_versions == []
    # Refused once: every attempt would refuse the same (no worker-group restart, no Prefect retry). The data is
    # read by the driver's check and once by each worker.
    assert resumed_spec.changed_starts.count("start") == 3, resumed_spec.changed_starts


@pytest.mark.slow
def test_a_train_specs_checkpoints_are_named_by_epoch_and_a_retrained_epoch_gets_a_folder_of_its_own(
    resumed_spec: SimpleNamespace,
) -> None:
    """A TrainSpec's checkpoint folders are named for their epoch (epoch-0001, ...), as the built-in classifier's
    are. A resume that passes over a tampered newest checkpoint retrains that epoch into epoch-0002-r1: the folder
    of the checkpoint it replaces is never written into (Ray Train, evicting the old entry later, would delete the
    new checkpoint with it), and the run finishes in the same MLflow run."""
    run_dir = resumed_spec.run_dir
    assert resumed_spec.stopped_folders == ["epoch-0001", "epoch-0002"], resumed_spec.stopped_folders
    resumed = resumed_spec.retrained
    assert resumed.is_completed(), resumed
    folders = resumed_spec.retrained_folders
    assert folders == ["epoch-0001", "epoch-0002", "epoch-0002-r1", "epoch-0003"], folders
    assert (run_dir / "epoch-0002" / "spec_state.pt").read_bytes() == b"tampered"  # never written into
    best = resumed.result().fit.best_checkpoint_uri.rstrip("/").rsplit("/", 1)[-1]
    assert best in {"epoch-0001", "epoch-0002-r1", "epoch-0003"}, best  # never the tampered one
    run = resumed_spec.retrained_run
    assert run.info.run_id == resumed_spec.stopped_run.info.run_id
    assert run.info.status == "FINISHED" and "epoch-0002" in run.data.tags["prefect_raytrain.resume_fallback"]
    assert resumed_spec.retrained_steps == [1, 2, 3], resumed_spec.retrained_steps  # epoch 2 retrained: logged once


@pytest.mark.slow
def test_a_folder_the_snapshot_points_at_is_never_resumed_from_by_user_code(resumed_spec: SimpleNamespace) -> None:
    """Whoever can write storage copies an older checkpoint of a TrainSpec's run to a folder of another name and
    points Ray Train's checkpoint snapshot at it. The user's code must not be handed it by get_checkpoint(): the
    fit refuses the record before any worker starts (raytrain_driver.ray_record), naming the foreign folder, and
    registers nothing, as the built-in classifier's does (test_security)."""
    from raytrain_tasks.errors import UnsafeCheckpointError

    state = resumed_spec.planted
    error = state.result(raise_on_failure=False)
    assert state.is_failed() and isinstance(error, UnsafeCheckpointError), error
    assert "planted-0003" in str(error), error
    # From the planted copy of epoch 1, epochs 2 and 3 would have been trained again, into folders of their own.
    assert resumed_spec.planted_folders == [*resumed_spec.retrained_folders, "planted-0003"]
    assert resumed_spec.planted_steps == [1, 2, 3], resumed_spec.planted_steps
    assert resumed_spec.planted_models == []


def test_a_train_spec_without_a_held_out_test_split_is_refused_before_training() -> None:
    """The gate compares test_<metric>: without a test split it would never be reported, and the run used to fail
    only after its last epoch, with advice for a TrainFunc. The spec's loop refuses it as the data is loaded."""
    import torch
    from torch.utils.data import TensorDataset

    from raytrain_tasks.api import Splits, TrainSpec
    from raytrain_tasks.trainspec.loop import _splits

    rows = TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    spec = TrainSpec(
        data=lambda config: Splits(train=rows, val=rows),
        model=lambda config, example: torch.nn.Linear(2, 1),
        loss=torch.nn.functional.mse_loss,
        metric=Metric("loss", higher_is_better=False),
    )
    with pytest.raises(UserCodeError, match=r"without a test split: .* test_loss, .* Splits\(train, val, test\)"):
        _splits(spec, {})
    with_test = TrainSpec(
        data=lambda config: Splits(train=rows, val=rows, test=rows),
        model=spec.model,
        loss=spec.loss,
        metric=spec.metric,
    )
    assert _splits(with_test, {}).test is rows


@pytest.mark.usefixtures("prefect_api")
def test_a_train_spec_without_a_test_split_fails_the_run_before_ray_or_an_mlflow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found where the fit starts, on the driver, in seconds: not by every worker once Ray has started them (the
    newcomer's walk met it there). No Ray starts, no MLflow run or checkpoint is made, nothing is registered."""
    import os

    calls = tmp_path / "data-calls.txt"
    source = f"""
        import os, torch
        from torch.utils.data import TensorDataset
        from raytrain_tasks.api import Metric, Splits, TrainSpec

        def data(config):
            with open({str(calls)!r}, "a") as out:
                out.write(f"{{os.getpid()}}\\n")
            rows = TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1))
            return Splits(train=rows, val=rows)

        training = TrainSpec(data=data, model=lambda c, e: torch.nn.Linear(2, 1),
                             loss=torch.nn.functional.mse_loss, metric=Metric("loss", higher_is_better=False))
    """
    name = _module(tmp_path, monkeypatch, source, name="no_test_split")
    config = own_config(tmp_path, f"{name}:training", epochs=2)
    with ThreadPoolExecutor(1) as pool:
        state = start_flow(pool, config).result(timeout=300)
    assert state.is_failed()
    assert "without a test split" in str(state.result(raise_on_failure=False))
    assert calls.read_text().split() == [str(os.getpid())]  # once, here: no Ray Train worker ran data()
    assert only_run(tmp_path) is None and not (tmp_path / "storage" / "runs").exists()
    assert client_versions(tmp_path) == []


def test_a_train_spec_with_fewer_training_rows_than_workers_is_refused_before_any_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker trains on a share of the train split: with fewer rows than the most workers the run may have,
    one would get none (DistributedSampler would hand it repeats). Refused where the fit checks the spec's data,
    before an MLflow run or any worker, naming the settings, as the built-in classifier's tables always were."""
    from raytrain_driver.preflight import check_spec_data
    from raytrain_tasks.errors import DatasetError

    source = """
        import torch
        from torch.utils.data import TensorDataset
        from raytrain_tasks.api import Metric, Splits, TrainSpec

        rows = TensorDataset(torch.zeros(3, 2), torch.zeros(3, 1))
        training = TrainSpec(data=lambda config: Splits(train=rows, val=rows, test=rows),
                             model=lambda c, e: torch.nn.Linear(2, 1), loss=torch.nn.functional.mse_loss,
                             metric=Metric("loss", higher_is_better=False))
    """
    name = _module(tmp_path, monkeypatch, source, name="three_rows")
    config = own_config(tmp_path, f"{name}:training", num_workers=1, max_workers=8, train_config="{}")
    refused = r"has 3 rows, fewer than the 8 workers .* lower `num_workers` \(and `max_workers`\)"
    with pytest.raises(DatasetError, match=refused):
        check_spec_data(config, resolve(config.train_code), None)
    assert check_spec_data(config.model_copy(update={"max_workers": 3}), resolve(config.train_code), None) is False


def test_an_error_in_a_train_specs_data_on_the_driver_is_the_users_with_its_frames() -> None:
    """data() fails where the fit checks it first: a UserCodeError (not retried) with the user's own frame, not a
    bare KeyError that Prefect would retry `fit_retries` times."""
    from raytrain_tasks.api import TrainSpec
    from raytrain_tasks.trainspec.loop import SpecTrainFunc

    def my_data(config: dict[str, Any]) -> Any:
        return config["source_dir"]

    spec = TrainSpec(data=my_data, model=print, loss=print, metric=Metric("loss", higher_is_better=False))
    with pytest.raises(UserCodeError, match=r"TrainSpec.data failed on the driver: KeyError: 'source_dir'\n.*my_data"):
        SpecTrainFunc(spec).check_data({})


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_an_empty_ray_dataset_split_or_a_missing_column_is_refused_on_the_driver() -> None:
    """A Ray Dataset split with no row would score NaN (which must never take an alias): refused where the fit
    checks the data, as a missing column is, before any worker."""
    import ray.data

    from raytrain_tasks.api import Splits, TrainSpec
    from raytrain_tasks.errors import DatasetError
    from raytrain_tasks.trainspec.loop import SpecTrainFunc

    rows = ray.data.from_items([{"x": [float(i)], "y": [2.0 * i]} for i in range(8)])

    def spec_of(splits: Splits) -> SpecTrainFunc:
        return SpecTrainFunc(
            TrainSpec(data=lambda config: splits, model=print, loss=print, metric=Metric("loss", False))
        )

    with pytest.raises(DatasetError, match="empty test split"):
        spec_of(Splits(rows, rows, rows.filter(lambda row: False), columns=("x", "y"))).check_data({})
    with pytest.raises(DatasetError, match="no column 'features'"):
        spec_of(Splits(rows, rows, rows, columns=("features", "y"))).check_data({})
    assert spec_of(Splits(rows, rows, rows, columns=("x", "y"))).check_data({}) is True  # Ray Datasets, usable
