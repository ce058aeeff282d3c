"""A digest over every file of a checkpoint folder, whoever wrote them (rank 0 alone, or every rank).

For the user's own checkpoints, whose format the pipeline does not know: the controller computes it once Ray
Train has persisted the folder (all ranks' files are in it by then) and records it in MLflow; before anything of
the folder is loaded (the user's ``load_model`` may unpickle), the local copy must hash the same. A rank's file
that is missing, added or changed gives another digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


def folder_digest(filesystem: Any, path: str) -> str:
    """SHA-256 over the sorted (relative path, size, SHA-256) of every file under ``path`` on a pyarrow filesystem."""
    import pyarrow.fs as pafs

    root = path.rstrip("/")
    entries = []
    for info in filesystem.get_file_info(pafs.FileSelector(root, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        digest = hashlib.sha256()
        with filesystem.open_input_stream(info.path) as stream:
            while chunk := stream.read(CHUNK):
                digest.update(chunk)
        entries.append((info.path[len(root) + 1 :], info.size, digest.hexdigest()))
    return _combine(entries)


def local_folder_digest(directory: Path, ignore: Callable[[Path], bool] | None = None) -> str:
    """``folder_digest`` of a local folder (a downloaded copy), without the files ``ignore`` names."""
    entries = []
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and not (ignore and ignore(p))):
        digest = hashlib.sha256()
        with file.open("rb") as stream:
            while chunk := stream.read(CHUNK):
                digest.update(chunk)
        entries.append((file.relative_to(directory).as_posix(), file.stat().st_size, digest.hexdigest()))
    return _combine(entries)


def _combine(entries: list[tuple[str, int, str]]) -> str:
    # One line per file, "name<TAB>size<TAB>sha". A name holding a tab, a newline or a leading quote is written
    # as a JSON string instead, so no two different folders give the same listing; every other name is written
    # as it is, so the digests recorded for existing runs stay valid.
    listing = "\n".join(f"{_listed(name)}\t{size}\t{sha}" for name, size, sha in sorted(entries))
    return hashlib.sha256(listing.encode()).hexdigest()


def _listed(name: str) -> str:
    return json.dumps(name) if "\t" in name or "\n" in name or name.startswith('"') else name
