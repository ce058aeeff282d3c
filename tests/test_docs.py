"""The README documents every config field and flag, so the docs cannot drift from the model."""

from __future__ import annotations

from raytrain_tasks.config import TrainingConfig
from tests.conftest import REPO_ROOT


def test_readme_documents_every_config_field() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    missing = [name for name in TrainingConfig.model_fields if f"`--{name.replace('_', '-')}`" not in readme]
    assert missing == []


def test_readme_starts_with_the_two_commands() -> None:
    head = (REPO_ROOT / "README.md").read_text()[:1500]
    assert "make run" in head and "make test" in head
