"""The table classifier's model: an MLP mapping a float32 batch ``[N, in_features]`` to logits
``[N, num_classes]``, behind a fixed standardisation layer so that it takes raw feature rows."""

from __future__ import annotations

from collections.abc import Sequence
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
