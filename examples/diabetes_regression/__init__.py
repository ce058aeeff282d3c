"""A regression with a lower-is-better metric (RMSE on scikit-learn's bundled diabetes table)."""
