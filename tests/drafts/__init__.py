"""Tests of specdec_jax/drafts."""
