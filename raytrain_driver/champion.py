"""Loading the registered champion to score it: only the exact files MLflow's pytorch flavor writes in the ``pt2``
format are loaded, from one local copy, with MLflow's pickle deserialization switched off for the load.

Whoever can write the registry's artifact store chooses those files. A ``pt2`` archive is an exported program
(MLflow checks that it holds no pickles once pickles are off); a ``data/model.pth`` placed beside it would be
unpickled by ``mlflow.pyfunc.load_model``, because MLFLOW_ALLOW_PICKLE_DESERIALIZATION defaults to true.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_driver.promotion import CHAMPION, Champion

# A registered version's input schema (what its inputs and outputs mean): a champion of another one is not compared.
SCHEMA_TAG = "schema.digest"
TRAIN_CODE_TAG = "train_code"  # the code that trained a version (none: a version of releases up to 0.2)


def digest_of_schema(schema: Mapping[str, Any]) -> str:
    """The digest a version records of its schema: SHA-256 of its JSON text, keys in the order given."""
    return hashlib.sha256(json.dumps(dict(schema)).encode()).hexdigest()[:16]


if TYPE_CHECKING:
    from mlflow import MlflowClient

# What `mlflow.pytorch.log_model(..., serialization_format="pt2", input_example=...)` writes (MLflow 3.17.2,
# checked on a real store), and so everything a champion may hold.
PT2_LAYOUT = frozenset(
    {
        "MLmodel",
        "conda.yaml",
        "python_env.yaml",
        "requirements.txt",
        "input_example.json",
        "serving_input_example.json",
        "data/model.pt2",
    }
)
# Written by MLflow itself into the local copy of a registered version (its name and version, as YAML).
WRITTEN_ON_DOWNLOAD = frozenset({"registered_model_meta"})


@dataclass(frozen=True)
class ModelLayout:
    """What the files of a model say about loading it; both empty: it is this project's pt2 layout exactly."""

    foreign: str = ""  # another format than this project logs: its scores are not comparable
    tampered: str = ""  # this project's format with files it never writes: refused, never loaded


def check_model_layout(directory: Path) -> ModelLayout:
    """Read the MLmodel file (YAML, safe) and the file names under ``directory``; nothing of the model is loaded."""
    from mlflow.models import Model

    flavors = Model.load(str(directory)).flavors
    if set(flavors) != {"python_function", "pytorch"}:
        return ModelLayout(
            foreign=f"its model flavors {sorted(flavors)} are not the pytorch pt2 format this project logs and loads"
        )
    if flavors["python_function"].get("code") or flavors["pytorch"].get("code"):
        return ModelLayout(foreign="it ships its own code (code_paths), which scoring it would import")
    entries = {path.relative_to(directory).as_posix(): path for path in directory.rglob("*")}
    files = {name for name, path in entries.items() if not (path.is_dir() and not path.is_symlink())}
    if "data/model.pt2" not in files:
        return ModelLayout(
            foreign="it is stored as a pickled torch model, and loading it would unpickle arbitrary objects; it was "
            "not loaded or scored"
        )
    unexpected = sorted(files - PT2_LAYOUT - WRITTEN_ON_DOWNLOAD)
    links = sorted(name for name, path in entries.items() if path.is_symlink())
    folders = sorted(name for name, path in entries.items() if path.is_dir() and name != "data")
    config = (
        flavors["pytorch"].get("model_data"),
        flavors["python_function"].get("data"),
        flavors["python_function"].get("loader_module"),
    )
    if unexpected or links or folders or config != ("data", "data", "mlflow.pytorch"):
        found = ", ".join([*unexpected, *links, *folders]) or f"model_data/data/loader_module {config}"
        return ModelLayout(
            tampered=f"its model files hold {found}, which this project's pt2 format never writes (exactly "
            f"{', '.join(sorted(PT2_LAYOUT))}); someone else wrote to the registry's artifact store, so it was not "
            "loaded or scored"
        )
    return ModelLayout()


def download_model(model_uri: str, directory: Path) -> Path:
    """One local copy of the model's files: the layout is checked, and loaded, from the same bytes."""
    import mlflow

    return Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(directory)))


def read_champion(client: MlflowClient, name: str) -> Champion | tuple[str, dict[str, str]]:
    """The version the ``champion`` alias names and its tags; or, when there is nothing to read, the Champion to
    decide with: absent (no alias: the only case that counts as no champion), or open with the registry's error
    (fail closed: nothing moves)."""
    from mlflow.exceptions import MlflowException

    try:
        version = client.get_registered_model(name).aliases.get(CHAMPION)
        if version is None:
            return Champion.absent()
        return str(version), dict(client.get_model_version(name, str(version)).tags)
    except MlflowException as exc:
        return Champion(version=None, error=f"cannot read {name}@{CHAMPION} from the registry: {exc}")
