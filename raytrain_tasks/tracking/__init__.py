"""MLflow, in one home: ``controller`` logs each committed report live from Ray Train's controller (and names the
metrics); ``runs`` is the driver's side (open or reopen a run, its params, summary and models); ``pins`` and
``pin_journal`` record which checkpoints were committed (what a resume and the registry trust); ``run_owner`` tells
which process drives a run."""
