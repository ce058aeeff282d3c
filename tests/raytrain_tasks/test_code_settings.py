"""Your code's own settings (``settings=`` or ``defaults=``) against ``train_config``: what the code receives, and
what is refused before anything starts. No Ray, no Prefect server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
from pydantic import BaseModel, Secret, SecretStr

from raytrain_driver.preflight import resolve_code
from raytrain_tasks.api import Metric, TrainFunc, TrainSpec
from raytrain_tasks.code_settings import code_values, secret_keys
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import UserCodeError
from raytrain_tasks.user_code import user_config

IMAGE = "examples.image_classifier.train:training"


class Settings(BaseModel):
    hidden: int = 32
    activation: Literal["relu", "gelu"] = "relu"
    sizes: tuple[int, ...] = (8, 4)


@dataclass
class Required:
    source: str
    hidden: int = 3


def _func(**kwargs: object) -> TrainFunc:
    kwargs.setdefault("metric", Metric("val_loss", higher_is_better=False))
    return TrainFunc(lambda config: None, **kwargs)  # type: ignore[arg-type]


def test_a_settings_class_types_the_config_the_code_receives() -> None:
    config = TrainingConfig(train_code="my.code:training", train_config={"hidden": 64, "sizes": [2]}, epochs=3)
    received = user_config(config, _func(settings=Settings))
    # Typed and complete (defaults filled), as plain JSON values the code and MLflow both see; the pipeline's own.
    assert received["epochs"] == 3
    assert {k: received[k] for k in ("hidden", "activation", "sizes")} == {
        "hidden": 64,
        "activation": "relu",
        "sizes": [2],
    }
    assert Settings(**received).hidden == 64  # read back typed
    params = config.public_params(
        code_values(_func(settings=Settings), config.train_config, config.train_code), secret_keys=()
    )
    assert params["train_config.hidden"] == 64 and params["train_config.activation"] == "relu"


@pytest.mark.parametrize(
    ("settings", "train_config", "says"),
    [
        (Settings, {"hiden": 64}, r"train_config sets 'hiden', which its settings class Settings does not declare "
         r"\(did you mean 'hidden' for 'hiden'\?\)"),
        (Settings, {"hidden": "many"}, r"train_config.hidden: Input should be a valid integer"),
        # Strict JSON types: a quoted number or a boolean is not an int (it trained on 64 and on 1 before)
        (Settings, {"hidden": "64"}, r"train_config.hidden: Input should be a valid integer \(got str\)"),
        (Settings, {"hidden": True}, r"train_config.hidden: Input should be a valid integer \(got bool\)"),
        (Settings, {"activation": "tanh"}, r"train_config.activation: Input should be 'relu' or 'gelu'"),
        (Required, {}, r"train_config.source: Field required. Its settings: source \(string, required\), hidden"),
    ],
)  # fmt: skip
def test_a_train_config_that_does_not_fit_the_settings_is_refused_naming_the_key(
    settings: type, train_config: dict[str, object], says: str
) -> None:
    with pytest.raises(UserCodeError, match=says):
        code_values(_func(settings=settings), train_config, "my.code:training")


def test_a_refused_value_is_not_repeated_in_the_message() -> None:
    """A value of the wrong type may be a secret pasted into the wrong key: the message names the key and the
    value's type only."""
    with pytest.raises(UserCodeError) as refused:
        code_values(_func(settings=Settings), {"hidden": "hunter2-token"}, "my.code:training")
    assert "hunter2-token" not in str(refused.value) and "(got str)" in str(refused.value)


def test_a_misspelt_key_beside_plain_defaults_is_refused_and_a_key_of_ones_own_passes() -> None:
    spec = _func(defaults={"hidden": 32, "dropout": 0.1})
    with pytest.raises(UserCodeError, match=r"train_config sets 'hiden', which its defaults do not have; did you "):
        code_values(spec, {"hiden": 64}, "my.code:training")
    assert code_values(spec, {"note": "x"}, "my.code:training") == {"hidden": 32, "dropout": 0.1, "note": "x"}
    # Setting `hidden` itself too: `hiden` is then a key of the code's own, not a misspelling of one left out.
    assert code_values(spec, {"hidden": 1, "hiden": 2}, "my.code:training")["hiden"] == 2


def test_a_quoted_number_beside_a_numeric_default_is_refused_before_any_worker() -> None:
    """{"hidden": "64"} beside defaults={"hidden": 32} reached the workers as text and failed there, half a
    minute later; other types are the code's own business (a default does not say what else it accepts)."""
    spec = _func(defaults={"hidden": 32, "dropout": 0.1, "layers": "auto", "verbose": False})
    with pytest.raises(UserCodeError, match=r"train_config.hidden is a quoted number .* default 32 is an integer: "):
        code_values(spec, {"hidden": "64"}, "my.code:training")
    with pytest.raises(
        UserCodeError, match=r"dropout is a quoted number .*a number: write it as a JSON number"
    ) as raised:
        code_values(spec, {"dropout": "0.25"}, "my.code:training")
    assert "0.25" not in str(raised.value)
    assert code_values(spec, {"layers": 3, "verbose": "1", "hidden": 64, "dropout": 1}, "my.code:training") == {
        "hidden": 64,
        "dropout": 1,
        "layers": 3,
        "verbose": "1",
    }
    assert code_values(spec, {"hidden": "wide"}, "my.code:training")["hidden"] == "wide"  # not a number: the code's


@dataclass
class OwnEpochs:
    num_epochs: int = 5


def test_another_name_for_a_pipeline_key_is_refused_and_a_keyerror_on_one_says_which_key_to_read() -> None:
    """Code ported from Ray's docs that reads config["num_epochs"] trained its own count whatever --epochs said
    (and the run's progress passed 100%): its defaults, settings class or train_config naming it are refused before
    anything starts, and a KeyError on it (no default anywhere) names the key the pipeline gives."""
    from raytrain_tasks.errors import user_frames

    with pytest.raises(TypeError, match=r"sets num_epochs, another name of the pipeline's own config\['epochs'\] "):
        _func(defaults={"num_epochs": 5, "hidden": 2})
    with pytest.raises(TypeError, match=r"config\['epochs'\] \(set with --epochs\)"):
        _func(settings=OwnEpochs)
    with pytest.raises(ValueError, match=r"config\['lr'\] \(set with --learning-rate\)"):
        TrainingConfig(train_code="my.code:training", train_config={"learning_rate": 0.1})
    assert "as 'epochs': read that key" in user_frames(KeyError("num_epochs"))
    assert user_frames(KeyError("hidden")) == "KeyError: 'hidden'"
    assert _func(defaults={"max_epochs": 1}).defaults == {"max_epochs": 1}  # may be a scheduler's: passes


def test_the_examples_settings_are_checked_where_the_run_starts() -> None:
    """The image example declares its settings: the driver's check (the CLI's, the flow's) refuses what does not
    fit, before prepare-data or any worker."""
    with pytest.raises(UserCodeError, match=r"train_config.channels: Input should be a valid integer"):
        resolve_code(TrainingConfig(train_code=IMAGE, train_config={"channels": "wide"}, register=False))
    assert resolve_code(TrainingConfig(train_code=IMAGE, train_config={"channels": 8}, register=False)) is not None


class Opaque:
    pass


@dataclass
class Unvalidatable:
    thing: Opaque


class Epochs(BaseModel):
    epochs: int = 3


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"settings": dict}, r"must be a pydantic BaseModel subclass or a dataclass"),
        ({"settings": Settings()}, r"must be a class"),
        ({"settings": Settings, "defaults": {"hidden": 1}}, r"defaults=... or settings=..., not both"),
        ({"settings": Epochs}, r"settings=Epochs\) may not set epochs"),
        ({"settings": Unvalidatable}, r"settings=Unvalidatable\): pydantic cannot describe its fields"),
        # Refused here, not once the run's MLflow run exists (where each retry failed on it again).
        (
            {"defaults": {"lr_schedule(warmup)": 1}},
            r"TrainFunc\(defaults=\.\.\.\): the setting 'lr_schedule\(warmup\)' cannot be the MLflow param",
        ),
    ],
)
def test_a_settings_class_is_checked_when_the_spec_is_made(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(TypeError, match=says):
        _func(**kwargs)
    with pytest.raises(TypeError, match=says.replace("TrainFunc", "TrainSpec")):
        TrainSpec(data=print, model=print, loss=print, metric=Metric("loss", False), **kwargs)  # type: ignore[arg-type]


def test_a_served_deployment_of_code_with_settings_has_a_typed_form(prefect_api: None) -> None:
    """The Prefect UI's run form of a deployment that names the image example: train_config is one typed field per
    setting, with its default, and Prefect's server refuses a run whose train_config does not fit."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    from deployments.serve import build_deployments

    own, plain = build_deployments(
        [{"name": "images", "parameters": {"train_code": IMAGE}}, {"name": "ad-hoc"}]
    )  # fmt: skip
    form = own._parameter_openapi_schema.properties["train_config"]
    assert form["properties"]["channels"] == {"default": 16, "title": "Channels", "type": "integer"}
    assert form["properties"]["image_dir"]["type"] == "string" and form["additionalProperties"] is False
    assert form["position"] == plain._parameter_openapi_schema.properties["train_config"]["position"]
    assert plain._parameter_openapi_schema.properties["train_config"]["additionalProperties"] is True
    # The typed form is its code's: other code, with settings of its own, cannot be pointed at from this deployment.
    assert own._parameter_openapi_schema.properties["train_code"]["enum"] == [IMAGE]
    deployment_id = own.apply()
    with get_client(sync_client=True) as client:
        for wrong, says in (({"chanels": 8}, "'chanels' was unexpected"), ({"channels": "x"}, "train_config.channels")):
            with pytest.raises(PrefectHTTPStatusError, match="409") as refused:
                client.create_flow_run_from_deployment(deployment_id, parameters={"train_config": wrong})
            assert says in refused.value.response.text
        with pytest.raises(PrefectHTTPStatusError, match="409"):
            client.create_flow_run_from_deployment(deployment_id, parameters={"train_code": "other.code:training"})
        run = client.create_flow_run_from_deployment(deployment_id, parameters={"train_config": {"channels": 8}})
        assert run.parameters["train_config"] == {"channels": 8}
        client.delete_flow_run(run.id)  # nobody serves it: it would stay Scheduled


# --- a metric chosen by a setting: metric=<function of config> ----------------------------------------------------


def _spec(metric: object, **kwargs: object) -> TrainSpec:
    import torch

    return TrainSpec(
        data=print,  # type: ignore[arg-type]
        model=print,  # type: ignore[arg-type]
        loss=torch.nn.functional.mse_loss,
        metrics=lambda outputs, targets: {"mae": (outputs - targets).abs().mean()},
        metric=metric,  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


class Selection(BaseModel):
    select_by: Literal["mae", "loss"] = "mae"


def _chosen(spec: TrainFunc | TrainSpec, select_by: str) -> TrainFunc:
    from raytrain_tasks.trainspec.loop import as_train_func
    from raytrain_tasks.user_code import bind

    func = as_train_func(spec) if isinstance(spec, TrainSpec) else spec
    return bind(func, TrainingConfig(train_code="my.code:training", train_config={"select_by": select_by}))


def test_a_setting_chooses_the_metric_that_picks_the_checkpoint_and_gates() -> None:
    choose = lambda config: Metric(config["select_by"], higher_is_better=False)  # noqa: E731
    spec = _spec(choose, settings=Selection)
    mae, loss = _chosen(spec, "mae"), _chosen(spec, "loss")
    assert (mae.metric, mae.gate) == (Metric("val_mae", False), Metric("test_mae", False))
    assert (loss.metric, loss.gate) == (Metric("val_loss", False), Metric("test_loss", False))
    func = _func(metric=lambda config: Metric(f"val_{config['select_by']}", higher_is_better=True), settings=Selection)
    assert _chosen(func, "mae").gate == Metric("val_mae", True)
    with pytest.raises(TypeError, match="metric is a function of config; the pipeline chooses it per run"):
        func.gate  # noqa: B018  # unbound: only the run's config says which


@pytest.mark.parametrize(
    ("choose", "says"),
    [
        (lambda config: "val_mae", r"its metric=... function returned a str, not a raytrain_tasks.api.Metric"),
        (lambda config: Metric("f1", True), r"chose 'f1': TrainSpec\(metric='f1'\) needs metrics"),
        (lambda config: Metric(config["nope"], True), r"its metric=... function failed: KeyError: 'nope'\n.*File"),
    ],
)
def test_a_metric_function_that_gives_no_usable_metric_is_refused_naming_it(choose: object, says: str) -> None:
    spec = _spec(choose, settings=Selection)
    if "f1" in says:  # a spec without metrics=...: only its loss is reported
        import torch

        spec = TrainSpec(data=print, model=print, loss=torch.nn.functional.mse_loss, metric=choose, settings=Selection)  # type: ignore[arg-type]
    with pytest.raises(UserCodeError, match=says):
        _chosen(spec, "mae")


def _named_by(monkeypatch: pytest.MonkeyPatch, code_names: object, **settings: object) -> str:
    """The model name a run of code with ``model_name=`` registers into, as the flow resolves it."""
    import sys
    import types
    from pathlib import Path

    from raytrain_driver.preflight import code_model_name

    module = types.ModuleType("named_code")
    module.training = TrainFunc(  # type: ignore[attr-defined]
        lambda config: None, metric=Metric("val_loss", False), defaults={"dataset": "x"}, model_name=code_names
    )
    monkeypatch.setitem(sys.modules, "named_code", module)
    settings.setdefault("register", False)  # it registers nothing: no load_model
    config = TrainingConfig(train_code="named_code:training", **settings)  # type: ignore[arg-type]
    return config.resolved(Path("/work"), {}, code_model_name(config)).model_name


def test_the_code_names_the_registered_model_unless_the_run_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """One registered model per dataset, named by the code: the gate compares models of one name, so a model of
    other data needs its own (the module's name, the default, would put every dataset behind one champion)."""
    per_dataset = lambda config: f"{config['dataset']}-model"  # noqa: E731
    assert _named_by(monkeypatch, per_dataset, train_config={"dataset": "flowers"}) == "flowers-model"
    assert _named_by(monkeypatch, per_dataset) == "x-model"  # the code's default
    assert _named_by(monkeypatch, per_dataset, model_name="chosen") == "chosen"  # the run's setting wins
    assert _named_by(monkeypatch, None) == "named_code"  # none given: the module
    # The table classifier: one per table, as the built-in classifier names its models
    from raytrain_driver.preflight import code_model_name

    for train_config, name in (({}, "digits-classifier"), ({"dataset": "data/churn.csv"}, "churn-classifier")):
        config = TrainingConfig(train_code="raytrain_tasks.table_classifier:classifier", train_config=train_config)
        assert code_model_name(config) == name


@pytest.mark.parametrize(
    ("model_name", "says"),
    [
        (lambda config: config["nope"], r"its model_name\(config\) failed: KeyError: 'nope'\n.*File"),
        (lambda config: "a/b's", r"its model_name\(config\) returned \"a/b's\": a registered model's name is"),
        (lambda config: None, r"its model_name\(config\) returned None: a registered model's name is"),
    ],
)
def test_a_model_name_function_that_gives_no_usable_name_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, model_name: object, says: str
) -> None:
    with pytest.raises(UserCodeError, match=r"train_code 'named_code:training': " + says):
        _named_by(monkeypatch, model_name)
    with pytest.raises(TypeError, match=r"TrainFunc\(model_name=...\) must be a function"):
        TrainFunc(lambda config: None, metric=Metric("val_loss", False), model_name="fixed")  # type: ignore[arg-type]


class Login(BaseModel):
    user: str = "reader"
    password: SecretStr


class Secrets(BaseModel):
    token: SecretStr
    pin: Secret[int]
    login: Login | None = None
    hidden: int = 32


def test_the_settings_that_hold_a_secret_are_found_by_their_types() -> None:
    assert secret_keys(Secrets) == {"token", "pin", "login"}
    assert secret_keys(Settings) == set() and secret_keys(None) == set()


def test_a_secret_setting_reaches_the_code_and_is_masked_wherever_the_run_shows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SecretStr setting was shown in clear in the flow's settings line (Prefect keeps its logs)
    and the run's ``train_config`` param, while the code got pydantic's mask."""
    import json
    import sys
    import types

    from raytrain_driver.preflight import code_secret_keys, shown_params
    from raytrain_driver.register_steps import version_tags
    from raytrain_tasks.config import non_default_settings

    module = types.ModuleType("secret_code")
    module.training = TrainFunc(lambda config: None, metric=Metric("val_loss", False), settings=Secrets)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "secret_code", module)
    given = {"token": "tok-in-clear-1", "pin": 9876, "login": {"password": "pw-in-clear-2"}, "hidden": 64}
    config = TrainingConfig(train_code="secret_code:training", train_config=given, register=False)
    spec = resolve_code(config)
    received = user_config(config, spec)
    assert (received["token"], received["pin"], received["login"]["password"]) == (
        "tok-in-clear-1",
        9876,
        "pw-in-clear-2",
    )
    params = shown_params(config, spec)
    assert params["train_config.token"] == "**********" and params["train_config.hidden"] == 64
    shown = [
        non_default_settings(config, code_secret_keys(config)),
        json.dumps(params),
        repr(version_tags(config, spec, 0.5)),
    ]
    for text in shown:
        for secret in ("tok-in-clear-1", "9876", "pw-in-clear-2"):
            assert secret not in text, (secret, text)
    assert '"hidden":64' in shown[0] and '"hidden":64' in shown[2]  # the rest is shown as given


def test_when_the_code_cannot_be_loaded_its_whole_train_config_is_masked() -> None:
    """Which settings are secrets cannot be told then: the settings line shows none of the values."""
    from raytrain_driver.preflight import code_secret_keys
    from raytrain_tasks.config import non_default_settings

    config = TrainingConfig(train_code="no_such_module:training", train_config={"token": "tok-in-clear-3"})
    assert code_secret_keys(config) == {"token"}
    assert "tok-in-clear-3" not in non_default_settings(config, code_secret_keys(config))
