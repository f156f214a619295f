"""Integrations with model libraries (transformers)."""
