"""A second record of checkpoint pins, on the orchestrator's own disk, for when MLflow is down.

A checkpoint is trusted on resume only if its digest was recorded outside the run's storage when it was committed
(storage cannot vouch for itself). MLflow is that record; while MLflow is unreachable, the controller's write of a
pin fails, and a crash before MLflow is back would leave intact checkpoints unpinned and passed over. So the
controller also appends every pin, with the epoch's metrics, to this journal, a file of the orchestrator's machine
(under its Prefect home, never in the run's storage), before it tries MLflow. When the fit ends, and before a
resume chooses its checkpoint, the driver copies into the MLflow run the pins and epochs MLflow lacks; a pin MLflow
has always stands.

The journal is written only where the controller runs on the driver's machine (a local Ray, or a cluster whose
head is this machine): elsewhere the file would land on another machine's disk, and pins stay MLflow's alone. A
journal is read only if it is a plain file of this user that nobody else may write or read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_tasks.redact import redact

logger = logging.getLogger(__name__)

# What MLflow accepts in a tag key (the pin is `prefect_raytrain.checkpoint_sha256.<folder name>`).
_FOLDER_NAME = re.compile(r"[\w\-. ]{1,200}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class JournalEntry:
    """One committed checkpoint: its folder, digest, epoch number (MLflow's step) and the epoch's metrics."""

    checkpoint: str
    sha256: str
    step: int
    metrics: dict[str, float]


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

    def append(self, run_id: str, entry: JournalEntry) -> bool:
        """Record one pin, on disk before this returns; False, with a warning, where it cannot be written.

        Each record starts on a line of its own, so one cut short by a crash never swallows the next."""
        if not self.here():
            return False
        record = {"run_id": run_id, "checkpoint": entry.checkpoint, "sha256": entry.sha256}
        data = ("\n" + json.dumps({**record, "step": entry.step, "metrics": entry.metrics}) + "\n").encode()
        path = Path(self.path)
        try:
            created = not path.parent.exists()
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                _fsync_dir(path.parent)
        except OSError as exc:
            logger.warning("could not record the pin of %s in %s: %s", entry.checkpoint, path, redact(str(exc)))
            return False
        return True

    def run_ids(self) -> set[str]:
        """The MLflow runs the journal holds pins of (``entries`` reads each, with its checks); OSError when the
        journal cannot be read."""
        text = Path(self.path).read_text(encoding="utf-8", errors="replace")
        found = set()
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("run_id"), str):
                found.add(record["run_id"])
        return found

    def entries(self, run_id: str) -> list[JournalEntry]:
        """What was recorded for the MLflow run ``run_id``, in order, the first record of a folder winning. A
        line cut short, or one that is not a well-formed record, is skipped. A journal that is not this user's
        own private plain file is not read at all (warned): its pins are then MLflow's alone."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return []
        except OSError as exc:
            logger.warning("not reading the pin journal %s: %s", self.path, redact(str(exc)))
            return []
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                logger.warning("not reading the pin journal %s: not a private file of this user", self.path)
                return []
            with os.fdopen(fd, "rb", closefd=False) as stream:
                text = stream.read().decode("utf-8", errors="replace")
        except OSError as exc:
            logger.warning("not reading the pin journal %s: %s", self.path, redact(str(exc)))
            return []
        finally:
            os.close(fd)
        found: dict[str, JournalEntry] = {}
        for line in text.splitlines():
            entry = _parse(line, run_id)
            if entry is not None:
                found.setdefault(entry.checkpoint, entry)
        return list(found.values())


def _parse(line: str, run_id: str) -> JournalEntry | None:
    try:
        record: Any = json.loads(line)
    except ValueError:
        return None  # blank, or cut short by a crash mid-write
    if not isinstance(record, dict) or record.get("run_id") != run_id:
        return None
    name, digest, step, metrics = (record.get(k) for k in ("checkpoint", "sha256", "step", "metrics"))
    if not (isinstance(name, str) and _FOLDER_NAME.fullmatch(name) and isinstance(digest, str)):
        return None
    if not _SHA256.fullmatch(digest) or not isinstance(step, int) or step < 1 or not isinstance(metrics, dict):
        return None
    numbers = {k: float(v) for k, v in metrics.items() if isinstance(k, str) and isinstance(v, int | float)}
    return JournalEntry(name, digest, step, numbers)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
