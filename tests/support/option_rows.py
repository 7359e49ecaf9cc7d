"""Sampling options written as one dict per row, e.g. {"temperature": 0.7, "bias": {3: 0.6}, "prompt": [1, 2]}.

The keys are SamplingParams' fields ("bias" for logit_bias), and "prompt" and
"generated" for a row's context (the float64 reference reads them as keyword
arguments of tests/support/sampling_reference.py).
"""

import numpy as np

from specdec_jax import PenaltyState, SamplingParams


def rows_params(rows):
  """SamplingParams of a list of per-row option dicts (every option field present)."""
  get = lambda name, default: [r.get(name, default) for r in rows]
  return SamplingParams.create(
    get("temperature", 1.0),
    top_k=get("top_k", 0),
    top_p=get("top_p", 1.0),
    min_p=get("min_p", 0.0),
    repetition_penalty=get("repetition_penalty", 1.0),
    frequency_penalty=get("frequency_penalty", 0.0),
    presence_penalty=get("presence_penalty", 0.0),
    logit_bias=get("bias", {}),
  )


def rows_state(rows, v):
  """PenaltyState of the rows' "prompt" and "generated" token lists."""
  p = max(1, max(len(r.get("prompt", ())) for r in rows))
  g = max(1, max(len(r.get("generated", ())) for r in rows))
  prompt = np.full((len(rows), p), -1, np.int32)
  gen = np.full((len(rows), g), -1, np.int32)
  lengths = np.zeros(len(rows), np.int32)
  for b, r in enumerate(rows):
    prompt[b, : len(r.get("prompt", ()))] = r.get("prompt", ())
    gen[b, : len(r.get("generated", ()))] = r.get("generated", ())
    lengths[b] = len(r.get("prompt", ()))
  return PenaltyState.from_prompt(prompt, lengths, v).add_tokens(gen, gen >= 0)
