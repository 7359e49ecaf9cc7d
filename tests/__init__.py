"""Test package (so that shared helpers import as `tests.stats`)."""
