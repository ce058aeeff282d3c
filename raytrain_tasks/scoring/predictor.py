"""One replica of the model, in a Ray actor of the scoring run's pool (``Dataset.map_batches``): it loads the files
the driver checked and handed over, never the registry's current ones, so every actor of a run predicts with the
version resolved when the run started, whatever moves the alias meanwhile."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from raytrain_tasks.errors import ScoringInputError
from raytrain_tasks.safe_load import pickle_deserialization_off
from raytrain_tasks.scoring.columns import FeaturePlan, predictions


def load_model_files(files: dict[str, bytes]) -> Any:
    """The torch module of an MLflow pt2 model given as its files' bytes (relative path -> bytes), loaded with
    pickle deserialization off from a private temporary copy."""
    import mlflow.pytorch

    folder = Path(tempfile.mkdtemp(prefix="prt-score-model-"))
    try:
        for name, data in files.items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        with pickle_deserialization_off():
            return mlflow.pytorch.load_model(str(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Predictor:
    """``map_batches``'s callable class: numpy batches of the key and feature columns in, predictions out."""

    def __init__(self, files: Any, plan: FeaturePlan, dtype: str, class_labels: tuple[str, ...], use_gpu: bool) -> None:
        """``files``: the model's files (relative path -> bytes), as the driver checked them."""
        import torch

        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.module = load_model_files(files).to(self.device)
        self.plan, self.dtype, self.class_labels = plan, np.dtype(dtype), class_labels

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch

        inputs = np.stack([batch[name] for name in self.plan.features], axis=1).astype(self.dtype, copy=False)
        if np.issubdtype(inputs.dtype, np.floating) and np.isnan(inputs).any():
            missing = np.isnan(inputs)
            column, row = self.plan.features[int(missing.any(axis=0).argmax())], int(missing.any(axis=1).argmax())
            key = batch[self.plan.key][row].item()
            raise ScoringInputError(
                f"input_path: rows without a value in the feature column {column!r} (the first: {self.plan.key} "
                f"{key!r}); the model cannot score them, and nothing was written. Fill or drop them first"
            )
        with torch.no_grad():
            outputs = self.module(torch.from_numpy(inputs).to(self.device))
        if isinstance(outputs, tuple | list):  # an exported program returns its outputs as a tuple
            outputs = outputs[0]
        return predictions(self.plan.key, batch[self.plan.key], outputs.cpu().numpy(), self.class_labels)
