"""One pipeline process deciding a champion under the registry lock (run by tests/raytrain_driver/test_registry.py).

    python -m tests.lock_contender URL MODEL OWNER HOLD_S LEASE_S MARKERS

Inside the lock it reads the model's `counter` tag, holds the lock HOLD_S seconds (the decision), then writes
counter + 1 and which value it saw: with correct serialisation every contender sees the previous one's value.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mlflow import MlflowClient

from raytrain_driver.registry_lock import model_lock


def main(url: str, model: str, owner: str, hold_s: str, lease_s: str, markers: str) -> None:
    client = MlflowClient(url)
    marker = Path(markers)
    with model_lock(client, model, owner=owner, lease_s=float(lease_s), wait_s=180) as lock:
        (marker / f"{owner}.in").write_text(repr(time.time()))
        seen = client.get_registered_model(model).tags.get("counter", "0")
        time.sleep(float(hold_s))
        lock.check()
        client.set_registered_model_tag(model, "counter", str(int(seen) + 1))
        client.set_registered_model_tag(model, f"seen.{owner}", seen)
        (marker / f"{owner}.out").write_text(repr(time.time()))


if __name__ == "__main__":
    main(*sys.argv[1:])
