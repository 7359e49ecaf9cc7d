"""Tests of the examples/ scripts and the demo."""
