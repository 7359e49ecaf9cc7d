"""Tests of specdec_jax/grammar."""
