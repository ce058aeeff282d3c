"""docs/own-model.md is followed as a newcomer follows it: every command of its "Start from an example" section
runs, as written, in a fresh folder beside the checkout (named `prefect-raytrain`, as the guide assumes), with
the embedded defaults (MLflow and storage under ./.pipeline). The commands talk to the session's Prefect
API (`PREFECT_API_URL`, as a user with a Prefect server set up has it) rather than each starting a temporary one,
and train on the session's local Ray rather than each starting one: test_cli runs those defaults, and here they
would cost about a minute and a half."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.helpers import REPO_ROOT, joins_this_ray, this_ray_address

pytestmark = [pytest.mark.slow]

GUIDE = REPO_ROOT / "docs" / "own-model.md"


def guide_commands() -> list[str]:
    text = GUIDE.read_text()
    section = text[text.index("## Start from an example") : text.index("## Level 1")]
    return [
        line.strip()
        for block in re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def test_the_guide_has_commands_to_follow() -> None:
    commands = guide_commands()
    assert sum(command.startswith("prefect-raytrain train") for command in commands) >= 3, commands


@pytest.mark.usefixtures("prefect_api", "ray_cluster")
def test_every_command_of_the_guide_runs_from_a_fresh_folder(tmp_path: Path) -> None:
    """The section's commands run as one shell script, as a user types them in one terminal: the checkout's
    environment is what the guide's own `source .../activate` gives, not this test's (its `bin` is off PATH)."""
    from prefect.settings import PREFECT_API_URL

    (tmp_path / "prefect-raytrain").symlink_to(REPO_ROOT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API", "VIRTUAL_ENV"))}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    env["PREFECT_HOME"] = str(tmp_path / ".prefect")
    env.update(joins_this_ray())
    commands = guide_commands()
    script = "set -ex\n" + "".join(f"{command}\n" for command in commands)  # -x: each command, as it runs
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    output = done.stdout + done.stderr
    print(output[-6000:])
    assert done.returncode == 0, output[-4000:]
    trains = sum(command.startswith("prefect-raytrain train") for command in commands)
    assert output.count("training pipeline finished") == trains and output.count("model          ") == trains
    client = MlflowClient(f"sqlite:///{tmp_path / '.pipeline' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("prefect-raytrain")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert {run.data.params["train_code"] for run in runs} == {
        "my_model.train:training",
        "my_regression.train:training",
        "my_images.train:training",
    }
    assert all(run.info.status == "FINISHED" for run in runs)
    assert {run.data.tags["prefect_raytrain.ray_cluster"] for run in runs} == {this_ray_address()}
    (my_model,) = [run for run in runs if run.data.params["train_code"] == "my_model.train:training"]
    assert my_model.data.params["train_config.hidden"] == "64"  # --train-config reached the run's params
    (my_images,) = [run for run in runs if run.data.params["train_code"] == "my_images.train:training"]
    prepared = tmp_path / ".pipeline" / "storage" / "datasets" / my_images.data.tags["prefect_raytrain.dataset_hash"]
    assert len(list((prepared / "files").glob("*/*.png"))) == 1797  # its prepare's PNG files, stored by content
    assert "1797 PNG images of 10 classes in 1797 files" in output  # the line its prepare returned, logged
    # Its artifacts(...) wrote the registered model's confusion matrix, logged under the run's evaluation/.
    matrix = json.loads(
        Path(client.download_artifacts(my_images.info.run_id, "evaluation/confusion_matrix.json")).read_text()
    )
    assert len(matrix["classes"]) == 10 and sum(map(sum, matrix["matrix"])) > 0, matrix
