"""Examples of your own training code run through the pipeline; each subpackage is one to copy."""
