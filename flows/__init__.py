"""Prefect flows. Importing this package applies the pipeline's process environment defaults (only where the user
has not set them) before Prefect reads its settings: raytrain_tasks/environment.py."""

from raytrain_tasks.environment import apply_process_defaults

apply_process_defaults()
