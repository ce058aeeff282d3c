"""Import boundaries: workers need no Prefect, and planning a run needs no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

# One interpreter per set of probes: it imports the big third-party packages that load none of the probes
# (checked), then imports each module in a fork of itself, as a fresh interpreter with those packages already
# loaded would: a module that loads a probe, itself or through any of them, is found as in an interpreter of its
# own, without paying their imports again for every module (seconds each).
_PROBE = """
import importlib, json, os, signal, sys, traceback
probes, preload, modules = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3].split(",")
for name in preload:
    importlib.import_module(name)
if loaded := [probe for probe in probes if probe in sys.modules]:
    raise SystemExit(f"{loaded} loaded by {preload} alone")
found = {}
for module in modules:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(120)  # a fork that deadlocks on a lock held at fork time ends instead of hanging the suite
        try:
            importlib.import_module(module)
            os.write(write, "".join("1" if probe in sys.modules else "0" for probe in probes).encode())
            code = 0
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(write)
    answer = os.read(read, len(probes)).decode()
    os.close(read)
    if os.waitpid(pid, 0)[1] != 0 or len(answer) != len(probes) or set(answer) - {"0", "1"}:
        raise SystemExit(f"importing {module} failed")
    found[module] = [probe for probe, bit in zip(probes, answer) if bit == "1"]
print(json.dumps(found))
"""
WORKER_MODULES = [
    "raytrain_tasks.trainspec.loop",
    "raytrain_tasks.tracking.controller",
    "raytrain_tasks.trainspec.checkpoint",
]
FLOW_MODULES = ["flows.training", "tasks.fit", "tasks.register", "tasks.data"]


def _loaded_after_import(probes: list[str], preload: list[str], modules: list[str]) -> dict[str, list[str]]:
    """For each module: the ``probes`` that importing it loads (after ``preload``, which must load none)."""
    command = [sys.executable, "-c", _PROBE, ",".join(probes), ",".join(preload), ",".join(modules)]
    out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def prefect_after_worker_imports() -> dict[str, list[str]]:
    return _loaded_after_import(["prefect"], ["torch", "ray", "ray.train", "mlflow"], WORKER_MODULES)


@pytest.fixture(scope="module")
def after_flow_imports() -> dict[str, list[str]]:
    return _loaded_after_import(["torch", "ray.train"], ["prefect", "ray", "mlflow", "pandas"], FLOW_MODULES)


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_worker_code_imports_without_prefect(module: str, prefect_after_worker_imports: dict[str, list[str]]) -> None:
    assert "prefect" not in prefect_after_worker_imports[module]


def test_a_fit_job_runs_where_prefect_is_not_installed() -> None:
    """launch_mode=ray_job ships the driver package and raytrain_tasks to the cluster and runs `python -m
    raytrain_driver.fit_job` there: every driver module imports in an interpreter where Prefect cannot be imported (a
    cluster image without it), and so does the job's code path (the fit, the Ray Job helpers, the registry)."""
    modules = sorted(
        ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        for folder in ("raytrain_driver", "raytrain_tasks/storage", "raytrain_tasks/tracking")
        for path in (REPO_ROOT / folder).glob("*.py")
    )
    code = (
        "import sys, importlib.abc\n"
        "class NoPrefect(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'prefect' or name.startswith('prefect.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoPrefect())\n"
        f"for module in {modules!r}: importlib.import_module(module)\n"
        "from raytrain_driver.fit_job import main\n"
        "from raytrain_driver.fit import fit_in_this_process\n"
        "from raytrain_driver.register import register\n"
        "print('prefect' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"
    assert "raytrain_driver.fit_job" in modules and "raytrain_tasks.tracking.runs" in modules


@pytest.mark.parametrize("module", FLOW_MODULES)
def test_flow_and_task_modules_do_not_load_torch(module: str, after_flow_imports: dict[str, list[str]]) -> None:
    assert "torch" not in after_flow_imports[module]


@pytest.mark.parametrize("module", FLOW_MODULES)
def test_flow_and_task_modules_do_not_load_ray_train(module: str, after_flow_imports: dict[str, list[str]]) -> None:
    """Ray Train's modules (about 1 s of imports here) load after `ray.init`, beside the temporary Prefect API's
    start (flows.cli.local_services), not before the CLI can start anything; the first fit of a process loads them."""
    assert "ray.train" not in after_flow_imports[module]


def test_the_clis_check_of_the_default_code_leaves_ray_train_for_after_rays_start() -> None:
    """The CLI checks train_code before the temporary Prefect API and Ray start (flows.cli.main), and they start
    only after it: Ray Train's modules (about 1.5 s here) imported by that check were on every run's way in."""
    code = (
        "import sys\n"
        "from flows.cli import _train_code_problem, parse_config\n"
        "assert _train_code_problem(parse_config([])) == ''\n"
        "print(sorted(m for m in sys.modules if m.startswith('ray.train')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_the_license_is_an_spdx_expression() -> None:
    """A `license = { text = ... }` table makes setuptools print a deprecation warning at every install."""
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


def test_nothing_in_the_repository_points_outside_it() -> None:
    """A clone has no `shared` folder beside it: a comment or doc that sends the reader there sends them nowhere."""
    needle = "../" + "shared"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    pointing_out = []
    for name in tracked.stdout.splitlines():
        path = REPO_ROOT / name
        if path.suffix not in {".py", ".md", ".yaml", ".toml", ".cfg", ".txt", ""} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        pointing_out += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if needle in line]
    assert pointing_out == []


def test_the_editable_install_warns_about_nothing(tmp_path: Path) -> None:
    """`make install` (pip install -e) printed setuptools' "Editable installation ... Please be careful with folders
    in your working directory" warning at every install; the flat layout is now stated (a plain .pth entry)."""
    build = "import sys; from setuptools import build_meta; print(build_meta.build_editable(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", build, str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith(".whl")


def test_the_flow_and_its_tasks_assume_nothing_of_the_table_classifier() -> None:
    """flows/ and tasks/ treat the table classifier as any training code: what its epochs and
    summaries show, its data's description, its gate, all come from the driver (raytrain_driver), not from names
    of its metrics or data written here."""
    found = [
        f"{path.relative_to(REPO_ROOT)}: {word}"
        for folder in ("flows", "tasks")
        for path in sorted((REPO_ROOT / folder).glob("*.py"))
        for word in ("val_accuracy", "num_classes", "class_labels", "num_features", "hidden_sizes")
        if word in path.read_text()
    ]
    assert not found, found
