"""What users call: the Python API, the `mergekit-ram` CLI, analysis and demo."""
