"""Prefect flows. Defaults below only apply where the user has not set them, before Prefect reads settings."""

import os
from pathlib import Path

# The temporary API server a flow starts without PREFECT_API_URL needs ~10 s for its first migrations on
# small machines; Prefect's 20 s default start timeout is too tight there.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# Offline machines otherwise log failed telemetry calls.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Prefect does not create missing parents of PREFECT_HOME (e.g. `.pipeline/prefect` on a fresh checkout) and
# then fails to open its database.
if os.environ.get("PREFECT_HOME"):
    Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
