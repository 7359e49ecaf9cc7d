"""specdec_jax: lossless speculative decoding for JAX, as jitted pure functions.

Public API:
  - `rejection_sample`, `RejectionOutput`, `PLACEHOLDER_TOKEN_ID` (rejection.py)
  - `SamplingParams`, `sample_tokens`, `process_logits` (sampling.py)
"""

from specdec_jax.rejection import PLACEHOLDER_TOKEN_ID, RejectionOutput, rejection_sample
from specdec_jax.sampling import SamplingParams, process_logits, row_keys, sample_tokens

__version__ = "0.1.0"
