"""Scripts that run inside a serving engine's own Python environment (package data, run by path)."""
