"""Tests of specdec_jax/models."""
