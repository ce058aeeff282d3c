"""Named model architectures: the one place to plug in your own model.

A builder takes the input width, the number of classes and the hidden sizes, and returns an
``nn.Module`` mapping a float32 batch ``[N, in_features]`` to logits ``[N, num_classes]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def build_mlp(in_features: int, num_classes: int, hidden_sizes: Sequence[int]) -> nn.Module:
    """A plain ReLU MLP: enough for tabular data and digits, and exportable by MLflow."""
    from torch import nn

    layers: list[nn.Module] = []
    width = in_features
    for size in hidden_sizes:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[int, int, Sequence[int]], nn.Module]] = {
    "mlp": build_mlp,
}


def with_standardisation(net: nn.Module, mean: Sequence[float], std: Sequence[float]) -> nn.Module:
    """``net`` behind a fixed standardisation layer: the served model takes raw features."""
    import torch
    from torch import nn

    class Standardise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32))
            self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32))

        mean: torch.Tensor
        std: torch.Tensor

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return (features - self.mean) / self.std

    return nn.Sequential(Standardise(), net)


def build_model(name: str, in_features: int, num_classes: int, hidden_sizes: Sequence[int]) -> nn.Module:
    try:
        builder = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)} (raytrain_tasks/models.py)") from None
    return builder(in_features, num_classes, hidden_sizes)
