"""The promotion gate for your own code: with ``evaluate`` (every TrainSpec has one), the champion and this run's
model are each loaded back from a real MLflow registry and scored on this run's data; without it, the scores
recorded at training time are compared. Real SQLite registry, real pt2 models; no Ray."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from torch import nn
from torch.utils.data import TensorDataset

from raytrain_driver.promotion import Promotion, decide_promotion
from raytrain_driver.register_steps import Candidate, assess_user_champion, user_schema, version_tags
from raytrain_tasks.api import Metric, Splits, TrainFunc, TrainSpec
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import UserCodeError
from raytrain_tasks.tracking import runs as tracking
from raytrain_tasks.trainspec.loop import as_train_func

TRAIN_CODE = "someones_project.train:training"
NAME = "gate-test"
# Today's held-out data: y = 2x. The champion was trained when it was y = -2x, and recorded an excellent score then.
X = torch.linspace(-1, 1, 16).unsqueeze(1)
TODAY = TensorDataset(X, 2 * X)


def finished_fit(tmp_path: Path, checkpoint: Path, scores: dict[str, float] | None = None) -> Any:
    """What a fit of one epoch leaves behind, its best checkpoint at ``checkpoint``."""
    from raytrain_driver.fit_record import FitResult

    return FitResult(
        run_key="20261127-040000-abcdef",
        run_uri=str(tmp_path),
        mlflow_run_id="r",
        mlflow_experiment_id="0",
        backend="gloo",
        epochs_completed=1,
        best_epoch=1,
        best_checkpoint_uri=str(checkpoint),
        best_metrics={},
        final_metrics={},
        history=[],
        reopened_mlflow_run=False,
        scores=scores or {},
    )


def linear(weight: float) -> nn.Module:
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(weight)
        model.bias.zero_()
    return model


def mse_today(model: Any, config: dict[str, Any]) -> dict[str, float]:
    inputs, targets = TODAY.tensors
    with torch.no_grad():
        return {"test_mse": float(((model(inputs) - targets) ** 2).mean())}


def spec(evaluate: Any = mse_today) -> TrainFunc:
    return TrainFunc(
        lambda config: None,
        metric=Metric("val_mse", higher_is_better=False),
        gate_metric="test_mse",
        load_model=lambda path, config: linear(0.0),
        input_example=lambda config: torch.zeros(2, 1),
        evaluate=evaluate,
    )


def log_pt2(uri: str, weight: float) -> str:
    import mlflow

    experiment = MlflowClient(uri).get_experiment_by_name("gate")
    assert experiment is not None
    with tracking.using_tracking_uri(uri), mlflow.start_run(experiment_id=experiment.experiment_id):
        info = mlflow.pytorch.log_model(
            linear(weight), name="model", input_example=torch.zeros(2, 1).numpy(), serialization_format="pt2"
        )
    return str(info.model_uri)


def _assess(client: MlflowClient, name: str, config: TrainingConfig, code: TrainFunc, uri: str) -> tuple[Any, float]:
    """The gate's view of the champion of ``name`` and the candidate at ``uri`` (its recorded score 0.5)."""
    candidate = Candidate(config.model_copy(update={"model_name": name}), code, uri)
    return assess_user_champion(client, candidate, recorded=0.5)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> tuple[MlflowClient, TrainingConfig, str]:
    """A champion (y = -2x: wrong today) registered with a recorded test_mse of 0.001 (right on its own data), and
    this run's model (y = 2x), logged. The tests only read them (exporting a pt2 model takes seconds)."""
    tmp_path = tmp_path_factory.mktemp("gate")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = TrainingConfig(
        storage_path=str(tmp_path / "storage"),
        mlflow_tracking_uri=uri,
        train_code=TRAIN_CODE,
        model_name=NAME,
    )
    client = MlflowClient(uri)
    client.create_experiment("gate", artifact_location=str(tmp_path / "artifacts"))  # never the working directory
    champion_uri = log_pt2(uri, -2.0)
    client.create_registered_model(NAME)
    tags = version_tags(config, spec(), 0.001)
    with tracking.using_tracking_uri(uri):  # the registry finds the logged model through the process's URI
        version = client.create_model_version(NAME, champion_uri, tags=tags, model_id=champion_uri.split("/")[-1])
    client.set_registered_model_alias(NAME, "champion", version.version)
    return client, config, log_pt2(uri, 2.0)


def test_with_evaluate_the_champion_and_the_candidate_are_scored_on_todays_data(
    registry: tuple[MlflowClient, TrainingConfig, str],
) -> None:
    """A nightly run on data that changed: the champion's recorded 0.001 was on other data; scored today (y = 2x)
    it is far off (16 x mean(x^2)), and the candidate (y = 2x) is exact, so it takes the alias. Compared by the
    recorded scores, the champion would be kept for ever."""
    client, config, candidate_uri = registry
    with tracking.using_tracking_uri(config.mlflow_tracking_uri):
        champion, candidate = _assess(client, NAME, config, spec(), candidate_uri)
    expected = float((16 * X**2).mean())
    assert champion.version == "1" and champion.score == pytest.approx(expected, rel=1e-5), champion
    assert candidate == pytest.approx(0.0, abs=1e-9)
    decision = decide_promotion(candidate, champion, min_improvement=0.0, higher_is_better=False)
    assert decision.action is Promotion.PROMOTE, decision


def test_without_evaluate_the_recorded_scores_are_compared(registry: tuple[MlflowClient, TrainingConfig, str]) -> None:
    client, config, candidate_uri = registry
    with tracking.using_tracking_uri(config.mlflow_tracking_uri):
        champion, candidate = _assess(client, NAME, config, spec(None), candidate_uri)
    assert champion.score == pytest.approx(0.001) and candidate == 0.5
    assert decide_promotion(candidate, champion, higher_is_better=False).action is Promotion.KEEP_CHAMPION


@pytest.mark.parametrize("fails_on", ["champion", "candidate", "metric"])
def test_an_evaluate_that_fails_moves_nothing_and_says_why(
    registry: tuple[MlflowClient, TrainingConfig, str], fails_on: str
) -> None:
    """The user's evaluate raises on either model, or returns no gate metric: the decision cannot be made, so it is
    UNDECIDED (no alias moves, register-model fails and a resume decides again), naming the error."""
    client, config, candidate_uri = registry
    champion_weight = -2.0

    def evaluate(model: Any, config: dict[str, Any]) -> dict[str, float]:
        weight = float(model(torch.ones(2, 1))[0, 0])
        if fails_on == "metric":
            return {"test_rmse": 1.0}
        if (fails_on == "champion") == (weight == champion_weight):
            raise RuntimeError(f"cannot score the {fails_on}")
        return mse_today(model, config)

    with tracking.using_tracking_uri(config.mlflow_tracking_uri):
        champion, candidate = _assess(client, NAME, config, spec(evaluate), candidate_uri)
    said = "test_rmse" if fails_on == "metric" else f"cannot score the {fails_on}"
    assert champion.version == "1" and said in champion.error, champion
    assert decide_promotion(candidate, champion, higher_is_better=False).action is Promotion.UNDECIDED


@pytest.mark.parametrize("evaluate", [mse_today, None], ids=["scored today", "recorded scores"])
def test_a_champion_of_another_signature_is_kept_as_incomparable_not_scored(
    registry: tuple[MlflowClient, TrainingConfig, str], evaluate: Any
) -> None:
    """The team's inputs grew from 3 features to 1... or any other shape: the champion cannot be called like this
    run's model, nor scored on its data (evaluate would raise, leaving every later run undecided, nothing ever
    registered as champion). It is incomparable: it keeps its alias unless replace_incomparable_champion asks."""
    import mlflow

    client, config, candidate_uri = registry
    uri = config.mlflow_tracking_uri
    experiment = client.get_experiment_by_name("gate")
    assert experiment is not None
    with tracking.using_tracking_uri(uri), mlflow.start_run(experiment_id=experiment.experiment_id):
        wide = mlflow.pytorch.log_model(
            nn.Linear(3, 1), name="model", input_example=torch.zeros(2, 3).numpy(), serialization_format="pt2"
        ).model_uri
    name = f"gate-test-wider-{'scored' if evaluate else 'recorded'}"
    client.create_registered_model(name)
    with tracking.using_tracking_uri(uri):
        version = client.create_model_version(
            name, wide, tags=version_tags(config, spec(), 0.001), model_id=wide.split("/")[-1]
        )
    client.set_registered_model_alias(name, "champion", version.version)

    with tracking.using_tracking_uri(uri):
        champion, candidate = _assess(client, name, config, spec(evaluate), candidate_uri)
    assert champion.version == str(version.version) and champion.score is None and not champion.error, champion
    assert "signature" in champion.incomparable and "3" in champion.incomparable, champion
    kept = decide_promotion(candidate, champion, higher_is_better=False)
    assert kept.action is Promotion.KEEP_INCOMPARABLE, kept
    replaced = decide_promotion(candidate, champion, higher_is_better=False, replace_incomparable=True)
    assert replaced.action is Promotion.REPLACE_INCOMPARABLE, replaced


def test_a_train_spec_evaluates_on_its_test_split_with_its_loss_and_metrics() -> None:
    """What a TrainSpec's evaluate computes: the mean loss and metrics over the whole test split (batched)."""
    spec = TrainSpec(
        data=lambda config: Splits(TODAY, TODAY, TensorDataset(X[:10], 2 * X[:10])),
        model=lambda config, example: linear(0.0),
        loss=lambda outputs, targets: ((outputs - targets) ** 2).mean(),
        metrics=lambda outputs, targets: {"mae": (outputs - targets).abs().mean()},
        metric=Metric("mae", higher_is_better=False),
    )
    evaluate = as_train_func(spec).evaluate
    assert evaluate is not None
    scores = evaluate(linear(1.0), {"batch_size": 3})
    errors = X[:10] - 2 * X[:10]
    assert scores["test_loss"] == pytest.approx(float((errors**2).mean()), rel=1e-6)
    assert scores["test_mae"] == pytest.approx(float(errors.abs().mean()), rel=1e-6)


def test_an_input_example_the_model_does_not_take_is_named_before_mlflow_exports_it(tmp_path: Path) -> None:
    """A wrong input_example (64 features for a 1-feature model) fails naming input_example, the shapes and the
    resume that registers without training, not with MLflow's export error about its serialization format."""
    from raytrain_driver.register_steps import user_model
    from raytrain_tasks.errors import UserCodeError
    from raytrain_tasks.integrity import local_folder_digest
    from tests.helpers import small_config

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    torch.save(linear(2.0).state_dict(), checkpoint / "model.pt")

    def load_model(path: Path, config: dict[str, Any]) -> nn.Module:
        model = linear(0.0)
        model.load_state_dict(torch.load(path / "model.pt", weights_only=True))
        return model

    fit = finished_fit(tmp_path, checkpoint)
    config = small_config(tmp_path, train_code=TRAIN_CODE)

    def code(inputs: int) -> TrainFunc:
        return TrainFunc(
            lambda c: None,
            metric=Metric("val_mse", higher_is_better=False),
            load_model=load_model,
            input_example=lambda c: torch.zeros(2, inputs),
        )

    with pytest.raises(UserCodeError, match=r"does not accept input_example \(shape \(2, 64\)\)") as refused:
        user_model(config, fit, code(64), local_folder_digest(checkpoint))
    assert "prefect-raytrain resume 20261127-040000-abcdef" in str(refused.value)
    model, example = user_model(config, fit, code(1), local_folder_digest(checkpoint))
    assert example.shape == (2, 1) and float(model.weight) == 2.0


def test_an_artifacts_function_that_fails_stops_registration_naming_its_frames() -> None:
    """The code's artifacts(...) runs before the model is logged or a version created: its error (with the user's
    own frame) fails registration, and nothing is registered."""
    from raytrain_driver.register_steps import user_artifacts
    from raytrain_tasks.errors import UserCodeError

    def my_confusion_matrix(model: Any, config: dict[str, Any], folder: Path) -> None:
        raise ValueError("no plot backend")

    def load_model(path: Path, config: dict[str, Any]) -> nn.Module:
        return nn.Linear(1, 1)

    spec = TrainFunc(
        lambda config: None,
        metric=Metric("val_loss", higher_is_better=False),
        load_model=load_model,
        input_example=lambda config: torch.zeros(1, 1),
        artifacts=my_confusion_matrix,
    )
    config = TrainingConfig(train_code="my.code:training")
    with pytest.raises(UserCodeError, match=r"artifacts\(...\) failed, so nothing was registered: ValueError: no "):
        with user_artifacts(config, spec, nn.Linear(1, 1), None):
            pytest.fail("the model was logged after a failed artifacts(...)")
    with pytest.raises(UserCodeError, match=r"in my_confusion_matrix"):
        with user_artifacts(config, spec, nn.Linear(1, 1), None):
            pass
    with pytest.raises(TypeError, match=r"TrainFunc\(artifacts=...\) works on registered models"):
        TrainFunc(lambda config: None, metric=spec.metric, artifacts=my_confusion_matrix)


class Kind(enum.StrEnum):
    LOGITS = "logits"


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({"class_labels": ["cat", "dog"], "output": "logits"}, ""),
        # numpy scalars and str enums pass json.dumps but not MLflow's yaml.safe_dump: handed on as plain JSON
        ({"threshold": np.float64(0.5), "kind": Kind.LOGITS, "sizes": [np.int64(3)]}, ""),
        ({"run_key": "mine"}, r"may not set \['run_key'\]: the pipeline sets them"),
        ({"scale": float("nan")}, r"returned a value that is not JSON"),
        ({"labels": {"a", "b"}}, r"returned a value that is not JSON"),
        ({"weights": np.zeros(3)}, r"returned a value that is not JSON"),
        (["cat", "dog"], r"returned list, not a dict with str keys"),
        (None, r"failed, so nothing was registered: KeyError: 'labels'(.|\n)*in my_metadata"),
    ],
)
def test_model_metadata_is_checked_before_anything_is_registered(metadata: Any, says: str) -> None:
    """``model_metadata(config)`` gives the registered model's MLflow metadata (class labels, ...): JSON values, the
    pipeline's own keys left alone; anything else (or an error in it, with the user's frame) fails registration
    before a model is logged, naming `model_metadata`."""
    from raytrain_driver.register_steps import user_metadata
    from raytrain_tasks.errors import UserCodeError

    def my_metadata(config: dict[str, Any]) -> Any:
        return config["labels"] if metadata is None else metadata

    spec = TrainFunc(
        lambda config: None,
        metric=Metric("val_loss", higher_is_better=False),
        load_model=lambda path, config: nn.Linear(1, 1),
        input_example=lambda config: torch.zeros(1, 1),
        model_metadata=my_metadata,
    )
    config = TrainingConfig(train_code="my.code:training")
    if not says:
        import yaml

        given = user_metadata(config, spec, None)
        plain = {"threshold": 0.5, "kind": "logits", "sizes": [3]} if "kind" in metadata else metadata
        assert given == plain and yaml.safe_load(yaml.safe_dump(given)) == given
        return
    with pytest.raises(UserCodeError, match=rf"train_code 'my.code:training': model_metadata\(config\) (.|\n)*{says}"):
        user_metadata(config, spec, None)


def test_a_version_description_fits_mlflows_column_however_large_the_train_config_and_scores(tmp_path: Path) -> None:
    """MLflow stores a version's description in 5000 characters: PostgreSQL and MySQL refuse a longer one, and
    the registration with it. A train_config of a few thousand characters (a vocabulary, a list of layers) and
    many reported figures made one; the description now shows the start of each and stays in the column."""
    from raytrain_driver.origin import DESCRIPTION_LIMIT, version_description
    from tests.helpers import small_config

    vocabulary = {f"token_{index}": index for index in range(340)}  # train_config stays under 6000 (a param)
    config = small_config(tmp_path, train_code=TRAIN_CODE, train_config={"dropout": 0.1, "vocabulary": vocabulary})
    scores = {f"val_class_{index}_recall": index / 400 for index in range(400)}
    fit = finished_fit(tmp_path, tmp_path, scores)
    description = version_description(config, None, fit, "val_mse", ())
    assert len(config.train_config_text()) > DESCRIPTION_LIMIT
    assert len(description) <= DESCRIPTION_LIMIT
    assert description.startswith(f"{TRAIN_CODE} trained by run") and '"dropout":0.1' in description
    assert "whole in the run's params" in description and "val_class_0_recall 0.0000" in description
    assert f"best checkpoint: epoch {fit.best_epoch} by val_mse" in description  # epochs as people count them


def test_a_versions_tags_and_description_hold_no_credential_of_the_train_config(tmp_path: Path) -> None:
    """The run's params mask a password in train_config; the registered version's ``train_config`` tag and its
    description carried the text as given (anyone who can read the registry could read it)."""
    from raytrain_driver.origin import version_description
    from tests.helpers import small_config

    sources = {
        "source": "postgresql://reader:hunter2secret@db:5432/rows",
        "url": "https://h/x?token=tok12345",
        "odd": 'postgresql://reader:hun"ter 2@sec@db/x',  # a quote, a space and an '@' in the password
    }
    config = small_config(tmp_path, train_code=TRAIN_CODE, train_config=sources)
    fit = finished_fit(tmp_path, tmp_path, {"val_mse": 0.5})
    shown = version_description(config, None, fit, "val_mse", ()) + repr(version_tags(config, spec(), 0.5))
    for secret in ("hunter2secret", "tok12345", "ter 2", "sec@"):
        assert secret not in shown, (secret, shown)
    assert "postgresql://reader:***@db:5432/rows" in shown, shown  # where it points is kept
    assert config.public_params(secret_keys=())["train_config"] in shown  # the same masking as the run's params


def test_a_champion_of_another_input_schema_is_kept_as_incomparable_not_scored(
    registry: tuple[MlflowClient, TrainingConfig, str],
) -> None:
    """Two models of one signature (a float per row in, one out) whose inputs mean different things: the code's
    schema(config) names them (a feature renamed); a champion of another schema, or of none recorded, keeps its
    alias and the reason is recorded, instead of being scored on data it was not made for."""
    import dataclasses

    client, config, candidate_uri = registry

    def reading(*names: str) -> TrainFunc:
        return dataclasses.replace(spec(), schema=lambda config: {"features": list(names), "classes": ["y"]})

    name = "gate-schema"
    client.create_registered_model(name)
    tags = version_tags(config, reading("x"), 0.001, user_schema(config, reading("x"), None))
    with tracking.using_tracking_uri(config.mlflow_tracking_uri):
        version = client.create_model_version(name, candidate_uri, tags=tags, model_id=candidate_uri.split("/")[-1])
        client.set_registered_model_alias(name, "champion", version.version)
        same, _ = _assess(client, name, config, reading("x"), candidate_uri)
        renamed, _ = _assess(client, name, config, reading("x_cm"), candidate_uri)
        unsaid, _ = _assess(client, name, config, spec(), candidate_uri)
    assert not same.incomparable and same.score is not None, same  # scored by evaluate on today's data
    for champion in (renamed, unsaid):
        assert champion.score is None and "input schema" in str(champion.incomparable), champion
        assert decide_promotion(0.0, champion, higher_is_better=False).action is Promotion.KEEP_INCOMPARABLE
    assert "none" in str(unsaid.incomparable)


def test_a_champion_the_built_in_classifier_registered_is_compared_with_the_table_classifiers_model(
    registry: tuple[MlflowClient, TrainingConfig, str],
) -> None:
    """The built-in classifier's versions record no train_code: a champion it registered was incomparable with
    every model of its own TrainSpec (raytrain_tasks.table_classifier, which registers under the same name), which
    then stayed `challenger` for ever. Of the same table (schema) and gate metric, it is compared now; of another
    table or metric, or against other code, it is still kept as incomparable."""
    import dataclasses

    from raytrain_driver.champion import digest_of_schema
    from raytrain_driver.register_steps import TABLE_CLASSIFIER

    client, config, candidate_uri = registry
    config = config.model_copy(update={"train_code": TABLE_CLASSIFIER})
    table = {"features": ["x"], "classes": ["y"]}
    ours = dataclasses.replace(
        spec(lambda model, config: {"test_loss": mse_today(model, config)["test_mse"]}),
        metric=Metric("val_loss", higher_is_better=False),
        gate_metric="test_loss",
        schema=lambda config: table,
    )
    name = "gate-built-in"
    client.create_registered_model(name)

    def champion_tagged(**tags: str) -> Any:
        with tracking.using_tracking_uri(config.mlflow_tracking_uri):
            version = client.create_model_version(name, candidate_uri, tags=tags, model_id=candidate_uri.split("/")[-1])
            client.set_registered_model_alias(name, "champion", version.version)
            return _assess(client, name, config, ours, candidate_uri)[0]

    built_in = {"schema.digest": digest_of_schema(table), "promotion.metric": "test_loss", "test_loss": "0.001"}
    same = champion_tagged(**built_in)
    assert not same.incomparable and same.score is not None, same  # scored by evaluate on today's split
    other_table = champion_tagged(**{**built_in, "schema.digest": digest_of_schema({**table, "features": ["z"]})})
    other_metric = champion_tagged(**{**built_in, "promotion.metric": "test_accuracy"})
    assert "input schema" in other_table.incomparable and "gate metric" in other_metric.incomparable
    config = config.model_copy(update={"train_code": TRAIN_CODE})
    with tracking.using_tracking_uri(config.mlflow_tracking_uri):
        against_other_code = _assess(client, name, config, ours, candidate_uri)[0]
    assert "trained by the built-in classifier" in against_other_code.incomparable, against_other_code


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (lambda config: config["nope"], r"schema\(config\) failed, so nothing was registered: KeyError: 'nope'"),
        (lambda config: [("features", ["x"])], r"schema\(config\) returned list, not a dict with str keys"),
        (lambda config: {"mean": torch.zeros(3)}, r"schema\(config\) returned a value that is not JSON"),
    ],
    ids=["raises", "a list", "a tensor of several values"],
)
def test_a_schema_function_that_gives_no_json_mapping_is_refused_before_anything_is_registered(
    schema: Any, says: str
) -> None:
    import dataclasses

    config = TrainingConfig(train_code=TRAIN_CODE)
    with pytest.raises(UserCodeError, match=rf"train_code '{TRAIN_CODE}': {says}"):
        user_schema(config, dataclasses.replace(spec(), schema=schema), None)
