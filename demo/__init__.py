"""Package data: read through importlib.resources (draftsmith.resources)."""
