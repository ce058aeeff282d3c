"""The docs cannot drift from the code: the configuration reference is generated from the config model, and
every link between the README, docs/ and the repository resolves."""

from __future__ import annotations

import re

from devtools.config_reference import TARGET, render
from raytrain_tasks.config import TrainingConfig
from tests.helpers import REPO_ROOT

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_configuration_reference_is_generated_from_the_config_model() -> None:
    assert TARGET.read_text() == render(), "docs/configuration.md is out of date: python -m devtools.config_reference"
    reference = TARGET.read_text()
    for name, field in TrainingConfig.model_fields.items():
        assert f"| `{name}` (`--{name.replace('_', '-')}`) |" in reference
        assert " ".join((field.description or "").split())[:60] in reference, name


def test_readme_starts_with_the_two_commands_and_points_to_the_docs() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make run" in readme[:1500] and "make test" in readme[:1500]
    assert "docs/configuration.md" in readme


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO_ROOT)} -> {target}")
    assert broken == []


def test_every_test_the_docs_name_exists() -> None:
    """The docs name the test that shows each promise (`test_x.py::test_y`); a renamed or merged test is renamed
    there too."""
    tests = {
        (path.name, name)
        for path in (REPO_ROOT / "tests").rglob("test_*.py")
        for name in re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.MULTILINE)
    }
    missing = [
        f"{page.relative_to(REPO_ROOT)}: {file}::{name}"
        for page in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
        for file, name in re.findall(r"(test_\w+\.py)::(test_\w+)", page.read_text())
        if (file, name) not in tests
    ]
    assert missing == []
