"""Test package (so that shared helpers import as `tests.support.stats`)."""
