"""The digest a checkpoint is pinned by: another folder never hashes alike, and existing pins stay valid."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain_tasks.integrity import folder_digest, local_folder_digest


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _folder(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir()
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_a_file_name_cannot_forge_the_listing_of_other_files(tmp_path: Path) -> None:
    """Two files, "a" and "b", against one file whose name spells out "a"'s line of the listing, then "b"."""
    a, b = b"x", b"model weights"
    two = _folder(tmp_path / "two", {"a": a, "b": b})
    one = _folder(tmp_path / "one", {f"a\t{len(a)}\t{_sha(a)}\nb": b})
    assert local_folder_digest(one) != local_folder_digest(two)


def test_a_name_in_quotes_is_not_taken_for_a_name_with_a_tab(tmp_path: Path) -> None:
    """A name holding a tab is listed as a JSON string; a name that already looks like one must not list alike."""
    tab = _folder(tmp_path / "tab", {"a\tb": b"same bytes"})
    quoted = _folder(tmp_path / "quoted", {'"a\\tb"': b"same bytes"})  # the six characters "a\tb"
    assert local_folder_digest(tab) != local_folder_digest(quoted)


@pytest.mark.parametrize(
    "names",
    [
        ["model.pt", 'q"uoted'],  # a quote inside a name is written raw
        ['"a"', "a"],  # one written as JSON, one raw: still two names
        ["tab\there", "tab", "here"],
        ["line\nbreak", "line", "break"],
        ["sub/dir/file", "sub/dir\tfile"],
    ],
)
def test_each_of_these_names_gives_its_own_digest_on_a_folder_and_on_a_filesystem(
    tmp_path: Path, names: list[str]
) -> None:
    digests = set()
    for index, name in enumerate(names):
        folder = _folder(tmp_path / f"f{index}", {name: b"same bytes"})
        local = local_folder_digest(folder)
        assert folder_digest(pafs.LocalFileSystem(), str(folder)) == local  # the driver's copy and storage agree
        digests.add(local)
    assert len(digests) == len(names)


def test_a_folder_of_ordinary_names_hashes_as_it_always_did(tmp_path: Path) -> None:
    """Checkpoints pinned before the encoding changed still verify: for names without a tab, a newline or a
    leading quote the listing is the one this digest has always hashed."""
    files = {"model.pt": b"weights", "meta/extra state.json": b"{}"}
    folder = _folder(tmp_path / "ckpt", files)
    listing = "\n".join(f"{name}\t{len(data)}\t{_sha(data)}" for name, data in sorted(files.items()))
    assert local_folder_digest(folder) == _sha(listing.encode())
