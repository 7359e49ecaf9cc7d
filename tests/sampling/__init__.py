"""Tests of specdec_jax/sampling."""
