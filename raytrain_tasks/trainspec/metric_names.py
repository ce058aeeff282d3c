"""Whether a TrainSpec's metric is one its loss and metrics give: checked on one validation batch before any
training (a typo), and over the whole split after the first epoch (a key a batch may lack)."""

from __future__ import annotations

from typing import Any

import torch

from raytrain_tasks.api import Metric, TrainSpec
from raytrain_tasks.errors import UserCodeError
from raytrain_tasks.trainspec.steps import batch_sums


def chosen_metric(spec: TrainSpec, config: dict[str, Any]) -> Metric:
    return spec.metric if isinstance(spec.metric, Metric) else spec.metric(config)


def batch_metric_names(spec: TrainSpec, model: Any, val_batches: Any, device: Any) -> list[str] | None:
    """The names ``loss`` and ``metrics`` give on this rank's first validation batch (``val_batches``: its slice;
    None when it has none), from the model as built: no training, and no random number drawn (a DataLoader's
    iterator draws one), so the trajectory stays the uninterrupted one's."""
    net = getattr(model, "module", model)  # not DDP's forward: no collective for a check some ranks may skip
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        batch = next(iter(val_batches), None)
        if batch is None:
            return None
        was_training = net.training
        net.eval()
        try:
            sums, _ = batch_sums(spec, net, [batch], device)
        finally:
            net.train(was_training)
    return sorted(sums)


def check_metric_named(
    spec: TrainSpec, config: dict[str, Any], names: list[str] | None, typos_only: bool = False
) -> None:
    """UserCodeError (not retried) when the spec's metric for this run is not one its ``loss``/``metrics`` give:
    found at the first epoch, not after the last one, where no checkpoint could be picked. ``typos_only``: only
    when one of ``names`` is close to it (names from one batch: a metric may leave a key out of a batch of one
    class, and is judged on the whole split after the first epoch's validation)."""
    if names is None:
        return
    chosen = spec.metric if isinstance(spec.metric, Metric) else spec.metric(config)
    if chosen.name in names:
        return
    import difflib

    lowered = {name.lower(): name for name in names}
    close = [lowered[chosen.name.lower()]] if chosen.name.lower() in lowered else []
    close = close or difflib.get_close_matches(chosen.name, names, n=1)
    if typos_only and not close:
        return
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UserCodeError(
        f"TrainSpec(metric={chosen.name!r}) names no metric this spec computes: its loss and metrics=... give "
        f"{names}{hint}. val_<metric> picks the best checkpoint and test_<metric> is what the gate compares: name "
        "one of those (or 'loss'), or return it from metrics=..."
    )
