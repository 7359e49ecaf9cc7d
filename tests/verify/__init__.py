"""Tests of specdec_jax/verify."""
