"""Which input columns feed a registered model, and what a scoring run's output holds: pure rules, as tables."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_tasks.errors import ScoringInputError
from raytrain_tasks.scoring.columns import FeaturePlan, ModelInputs, plan_features, predictions

COLUMNS = ["id", "a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("columns", "numeric", "inputs", "features"),
    [
        (COLUMNS, set(COLUMNS), ModelInputs(4), ("a", "b", "c", "d")),  # every column but the key, in order
        (COLUMNS, set(COLUMNS), ModelInputs(None), ("a", "b", "c", "d")),  # a signature without a fixed width
        # The model's metadata names its columns: those, in its order; others (text among them) are left out.
        (["d", "id", "note", "b"], {"id", "b", "d"}, ModelInputs(2, feature_names=("b", "d")), ("b", "d")),
        (["id", "a"], {"a"}, ModelInputs(1), ("a",)),  # a text key is fine: it is copied, not fed to the model
    ],
)
def test_the_model_is_fed_the_columns_it_takes_in_its_order(
    columns: list[str], numeric: set[str], inputs: ModelInputs, features: tuple[str, ...]
) -> None:
    assert plan_features(columns, numeric, "id", inputs) == FeaturePlan("id", features)


@pytest.mark.parametrize(
    ("columns", "numeric", "key", "inputs", "named"),
    [
        (COLUMNS, set(COLUMNS), "row_id", ModelInputs(4), "no column 'row_id' (key_column)"),
        (COLUMNS, set(COLUMNS), "id", ModelInputs(3), "takes 3 features a row (its signature), and the input has 4"),
        (COLUMNS, set(COLUMNS), "id", ModelInputs(2, feature_names=("a", "z")), "lacks the model's feature columns z"),
        (COLUMNS, set(COLUMNS) - {"c"}, "id", ModelInputs(4), "columns c are not numbers"),
    ],
)
def test_an_input_that_does_not_fit_the_model_is_refused_naming_the_setting(
    columns: list[str], numeric: set[str], key: str, inputs: ModelInputs, named: str
) -> None:
    with pytest.raises(ScoringInputError, match=named.replace("(", r"\(").replace(")", r"\)")):
        plan_features(columns, numeric, key, inputs)


def test_one_output_a_row_is_a_number_a_classs_outputs_are_its_label_and_others_a_row_of_numbers() -> None:
    keys = np.array([7, 8])
    one = predictions("id", keys, np.array([[0.5], [1.5]], dtype=np.float32), ())
    assert list(one) == ["id", "prediction"] and one["prediction"].tolist() == [0.5, 1.5]
    logits = np.array([[0.1, 0.9], [2.0, -1.0]], dtype=np.float32)
    labelled = predictions("id", keys, logits, ("cat", "dog"))
    assert labelled["prediction"].tolist() == ["dog", "cat"] and labelled["output"].shape == (2, 2)
    unlabelled = predictions("id", keys, logits, ("cat", "dog", "eel"))  # not one label per output: no labels
    assert unlabelled["prediction"].tolist() == logits.tolist() and "output" not in unlabelled
    assert unlabelled["id"] is keys


def test_a_batch_with_a_missing_feature_value_is_refused_naming_the_column_and_the_row(tmp_path: object) -> None:
    """The actor's check (a CSV input's gaps are found only as its rows are read): nothing is predicted for it."""
    import torch

    from raytrain_tasks.scoring.predictor import Predictor

    predictor = Predictor.__new__(Predictor)  # the model aside: the check comes before it is called
    predictor.device, predictor.module = torch.device("cpu"), torch.nn.Linear(2, 1)
    predictor.plan, predictor.dtype, predictor.class_labels = FeaturePlan("id", ("a", "b")), np.dtype("float32"), ()
    batch = {"id": np.array(["k1", "k2"]), "a": np.array([1.0, 2.0]), "b": np.array([0.5, np.nan])}
    with pytest.raises(ScoringInputError, match="feature column 'b' \\(the first: id 'k2'\\)"):
        predictor(batch)
    assert predictor({**batch, "b": np.array([0.5, 0.25])})["prediction"].shape == (2,)
