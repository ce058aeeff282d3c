"""A second record of checkpoint pins, on the orchestrator's own disk, for when MLflow is down.

A checkpoint is trusted on resume only if its digest was recorded outside the run's storage when it was committed
(storage cannot vouch for itself). MLflow is that record; while MLflow is unreachable, the controller's write of a
pin fails, and a crash before MLflow is back would leave intact checkpoints unpinned and passed over. So the
controller also appends every pin to this journal, a file of the orchestrator's machine (under its Prefect home,
never in the run's storage), before it tries MLflow. On resume, the driver copies the pins MLflow lacks from the
journal into the MLflow run, and the usual checks go on from there.

The journal is written only where the controller runs on the driver's machine (a local Ray, or a cluster whose
head is this machine): elsewhere the file would land on another machine's disk, and pins stay MLflow's alone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from raytrain_tasks.redact import redact

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PinJournal:
    """The journal of one run key: ``path`` on the machine named ``host`` (the driver's)."""

    path: str
    host: str

    @classmethod
    def for_run(cls, directory: Path, run_key: str) -> PinJournal:
        return cls(str(directory / f"{run_key}.jsonl"), socket.gethostname())

    def here(self) -> bool:
        """Whether this process runs on the driver's machine, where the journal belongs."""
        return socket.gethostname() == self.host

    def append(self, run_id: str, checkpoint: str, digest: str) -> bool:
        """Record one pin (flushed to disk before returning); False, with a warning, where it cannot be written."""
        if not self.here():
            return False
        line = json.dumps({"run_id": run_id, "checkpoint": checkpoint, "sha256": digest}) + "\n"
        try:
            Path(self.path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("could not record the pin of %s in %s: %s", checkpoint, self.path, redact(str(exc)))
            return False
        return True

    def pins(self, run_id: str) -> dict[str, str]:
        """checkpoint folder name -> digest recorded for the MLflow run ``run_id`` (the first one recorded wins;
        unreadable lines are skipped)."""
        try:
            lines = Path(self.path).read_text().splitlines()
        except FileNotFoundError:
            return {}
        found: dict[str, str] = {}
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash mid-write
            if not isinstance(entry, dict) or entry.get("run_id") != run_id:
                continue
            name, digest = entry.get("checkpoint"), entry.get("sha256")
            if isinstance(name, str) and isinstance(digest, str) and len(digest) == 64:
                found.setdefault(name, digest)
        return found
