"""A small CNN on image files, as a ``TrainSpec``: you give the data, the model, the loss and the metric; the
pipeline's loop trains it (DDP, a checkpoint every epoch, resume, the held-out test split, the gate).

``prepare`` is the run's prepare-data step: it writes the images as PNG files, one folder per class (as most image
datasets come), into the folder it is given. The pipeline stores that folder in ``<storage_path>/datasets/`` under
its content hash and hands ``data`` a local copy as ``config["data_dir"]``, on every worker of any node. The
images here are scikit-learn's bundled 8x8 digits: no download.

    prefect-raytrain train --train-code examples.image_classifier.train:training --epochs 5

To bring your own images: point ``image_dir`` at them (``--train-config '{"image_dir": "/data/my-images"}'``, one
sub-folder per class, readable where the flow runs: ``prepare`` copies them), and change ``build_model`` for your
image size and classes.

Its own settings are declared as a class (``Settings``): ``--train-config`` is checked against it before anything
starts (``{"chanels": 8}`` or ``{"channels": "many"}`` is refused, naming the key), and a deployment that names this
code shows one typed field per setting in the Prefect UI's run form.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from raytrain_tasks.api import Metric, Splits, TrainSpec


@dataclass
class Settings:
    """This code's own settings, beside the pipeline's (epochs, batch_size, lr, seed, ...): ``config`` holds both."""

    image_dir: str = ""  # a folder of <class>/<image> files to train on, instead of the bundled digits
    channels: int = 16  # the first convolution's output channels (the second has twice as many)


class ImageFolder(Dataset):
    """``<root>/<class>/<file>.png`` -> (a [1, H, W] float tensor in 0..1, the class index)."""

    def __init__(self, files: list[Path], classes: list[str]) -> None:
        self.files, self.index = files, {name: i for i, name in enumerate(classes)}

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, item: int) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.files[item]
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
        return torch.from_numpy(pixels).unsqueeze(0), torch.tensor(self.index[path.parent.name])


def prepare(config: dict[str, Any], folder: Path) -> str:
    """prepare-data: ``<folder>/<class>/<name>.png``, copied from ``image_dir``, or the bundled digits. Returns
    the line the run's log and pages show of what it wrote."""
    if config["image_dir"]:
        shutil.copytree(config["image_dir"], folder, dirs_exist_ok=True)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        for number, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
            path = folder / str(label) / f"{number:05d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray((image * 255.0 / 16.0).astype(np.uint8)).save(path, format="PNG")
    images = list(folder.glob("*/*.png"))
    return f"{len(images)} PNG images of {len({path.parent.name for path in images})} classes"


def split_of(path: Path) -> str:
    """A file's split follows from its name alone: stable as images are added, the same on every worker."""
    bucket = int(hashlib.sha256(f"{path.parent.name}/{path.name}".encode()).hexdigest()[:8], 16) % 100
    return "test" if bucket < 15 else "val" if bucket < 30 else "train"


def data(config: dict[str, Any]) -> Splits:
    root = Path(config["data_dir"])  # the local copy of what prepare wrote
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = sorted(root.glob("*/*.png"))
    by_split: dict[str, list[Path]] = {"train": [], "val": [], "test": []}
    for path in files:
        by_split[split_of(path)].append(path)
    return Splits(*(ImageFolder(by_split[name], classes) for name in ("train", "val", "test")))


def build_model(config: dict[str, Any], example: torch.Tensor) -> nn.Module:
    channels = config["channels"]
    return nn.Sequential(
        nn.Conv2d(example.shape[1], channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * channels, 10),
    )


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (outputs.argmax(1) == targets).float().mean()}


def artifacts(model: nn.Module, config: dict[str, Any], folder: Path) -> None:
    """Files about the model being registered, which the pipeline logs to its MLflow run under evaluation/: here
    the test split's confusion matrix (rows: true class, columns: predicted)."""
    classes = sorted(p.name for p in Path(config["data_dir"]).iterdir() if p.is_dir())
    matrix = torch.zeros(len(classes), len(classes), dtype=torch.int64)
    with torch.no_grad():
        for inputs, targets in DataLoader(data(config).test, batch_size=256):
            for true, predicted in zip(targets.tolist(), model(inputs).argmax(1).tolist(), strict=True):
                matrix[true, predicted] += 1
    (folder / "confusion_matrix.json").write_text(json.dumps({"classes": classes, "matrix": matrix.tolist()}))


def model_metadata(config: dict[str, Any]) -> dict[str, Any]:
    """What the registered model carries in its MLflow metadata, for whoever serves it: which class each output
    stands for (``mlflow.models.get_model_info("models:/<name>@champion").metadata["class_labels"]``)."""
    classes = sorted(p.name for p in Path(config["data_dir"]).iterdir() if p.is_dir())
    return {"class_labels": classes, "output": "logits; argmax is the index into class_labels"}


training = TrainSpec(
    data=data,
    model=build_model,
    loss=F.cross_entropy,
    metrics=accuracy,
    metric=Metric("accuracy", higher_is_better=True),
    prepare=prepare,
    settings=Settings,
    artifacts=artifacts,
    model_metadata=model_metadata,
)
