"""Benchmarks (make bench). Every one applies the pipeline's process environment defaults first, as the command does."""

from raytrain_tasks.environment import apply_process_defaults

apply_process_defaults()
