"""Integrations with model libraries (optional dependencies, imported on demand)."""
