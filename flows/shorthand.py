"""The command's flags for the table classifier's settings, which are keys of its ``train_config``."""

from __future__ import annotations

import argparse
from typing import Any

# Flags that write a key of the table classifier's train_config: `--dataset churn.csv` is
# `--train-config '{"dataset": "churn.csv"}'`.
SHORTHAND = {
    "dataset": "train_config's `dataset`: 'digits', 'synthetic', or a .csv/.parquet file's path or s3:// URI",
    "label_column": "train_config's `label_column`: the column holding each row's class",
}


def with_shorthand(overrides: dict[str, Any], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``overrides`` with the shorthand flags written into ``train_config``; refused for other code, which takes
    none of them, and where ``--train-config`` gives the same key another value."""
    from raytrain_tasks.errors import SettingsError
    from raytrain_tasks.moved_settings import with_keys_carried
    from raytrain_tasks.settings import TABLE_CLASSIFIER

    overrides = dict(overrides)
    given = {name: overrides.pop(name) for name in SHORTHAND if name in overrides}
    if not given:
        return overrides
    flags = " and ".join("--" + name.replace("_", "-") for name in given)
    if overrides.get("train_code", TABLE_CLASSIFIER) != TABLE_CLASSIFIER:
        parser.exit(2, f"{flags}: the table classifier's settings; give your train_code's in --train-config\n")
    try:
        return with_keys_carried(overrides, {name: (f"--{name}", value) for name, value in given.items()})
    except SettingsError:
        parser.exit(2, f"{flags} and --train-config give one key different values: give it once\n")


def moved_flag_problem(unknown: list[str]) -> str:
    """Why an unknown flag is refused, naming where a moved setting of the table classifier now goes."""
    from raytrain_tasks.moved_settings import MOVED

    for arg in unknown:
        name = arg.split("=", 1)[0].removeprefix("--").replace("-", "_")
        if name in MOVED and not MOVED[name][0]:
            return f"--{name} is gone: the MLP is the table classifier's one model (CHANGELOG.md)"
        if name in MOVED:
            return (
                f"{arg.split('=', 1)[0]} is a setting of the table classifier: give it in --train-config, e.g. "
                f"--train-config '{{\"{MOVED[name][0]}\": ...}}' (CHANGELOG.md)"
            )
    return f"unrecognized arguments: {' '.join(unknown)}"
