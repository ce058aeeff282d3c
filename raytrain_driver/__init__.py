"""The driver: everything that runs a training run outside the Ray workers and needs no Prefect.

Cluster connection and sizing, storage, the run lease, MLflow tracking, the fit's phases (pre-flight, open the
run, train, record), the Ray Job launch, evaluation, the registry lock, the promotion gate, and the champion's
history and rollback. The Prefect tasks (``tasks/``) call into it; a fit launched as a Ray Job
(``launch_mode=ray_job``) runs it on the cluster, where this package and ``raytrain_tasks`` are all that is
shipped, and Prefect need not be installed.
"""
