"""Tests of specdec_jax/loop."""
