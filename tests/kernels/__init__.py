"""Tests of specdec_jax/kernels."""
