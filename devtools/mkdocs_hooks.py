"""MkDocs hooks for the docs site (mkdocs.yml): the README is its home page, and links to the repository resolve.

The guides are written to be read on GitHub and in a checkout, where `docs/own-model.md` (from the README) and
`../examples/seed_ddp/train.py` (from a guide) are plain relative paths. On the site the README becomes
`index.md`, so its links into docs/ lose their `docs/` prefix. A link to a file outside docs/ gets a copy of that
file under `source/`, so the site serves it (a Markdown file is rendered as a page). A link to something that does
not exist is left as written, and `mkdocs build --strict` fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SOURCE = "source"  # where the site keeps its copies of linked repository files
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
FENCE = re.compile(r"^\s*(```|~~~)")


def _links(markdown: str) -> list[str]:
    """The relative link targets outside code blocks."""
    found, in_code = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            found += [m.group(2) for m in LINK.finditer(line) if not re.match(r"[a-z]+:", m.group(2))]
    return found


def _origin(file: File, docs_dir: Path) -> Path:
    """Where a page lies in the checkout: the README for the home page, a linked file's own place, or docs/."""
    if file.src_uri == "index.md":
        return README
    if file.src_uri.startswith(f"{SOURCE}/"):
        return ROOT / file.src_uri.removeprefix(f"{SOURCE}/")
    return docs_dir / file.src_uri


def _site_path(target: Path, docs_dir: Path) -> str | None:
    """A checkout file's path on the site, relative to docs/; None for what does not exist (left to --strict)."""
    if target == README:
        return "index.md"
    if target.is_relative_to(docs_dir):
        return target.relative_to(docs_dir).as_posix()
    if target.is_file() and target.is_relative_to(ROOT):
        return f"{SOURCE}/{target.relative_to(ROOT).as_posix()}"
    return None


def on_files(files: Files, config: Any) -> Files:
    docs_dir = Path(config["docs_dir"]).resolve()
    files.append(File.generated(config, "index.md", abs_src_path=str(README)))
    for page in list(files.documentation_pages()):
        origin = _origin(page, docs_dir)
        for target in _links(origin.read_text()):
            path = (origin.parent / target).resolve()
            site = _site_path(path, docs_dir)
            if site and site.startswith(f"{SOURCE}/") and files.get_file_from_path(site) is None:
                files.append(File.generated(config, site, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    origin = _origin(page.file, docs_dir)
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        if re.match(r"[a-z]+:", target):
            return match.group(0)
        site = _site_path((origin.parent / target).resolve(), docs_dir)
        if site is None:
            return match.group(0)
        return match.group(1) + posixpath.relpath(site, here or ".") + match.group(3)

    out, in_code = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            in_code = not in_code
        out.append(line if in_code else LINK.sub(rewrite, line))
    return "".join(out)
