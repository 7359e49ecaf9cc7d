"""Sampling: per-request parameters, one-pass reductions over the vocabulary, and `sample_tokens`.

The modules, in the order they build on each other:

  - `params`: `SamplingParams` (one entry per request) and the checks of concrete values.
  - `reductions`: one-pass (max, sum of exps, argmax) reductions over chunks of the vocabulary.
  - `penalties`: `PenaltyState` and steps 1-3 below (bias, repetition, frequency and presence).
  - `masks`: packed bitmasks of allowed tokens (`token_bitmask`, structured output), step 3b below.
  - `thresholds`: the top-k / top-p / min-p threshold search (step 4's filters).
  - `vocab_parallel`: the vocabulary split over the "model" axis of a mesh.
  - `draws`: drawing a token from unnormalised weights (Gumbel-max over chunks).
  - `stats`: `PositionStats`, what one pass over a position's logits knows (its passes chosen by a
    `StatsPlan` at trace time), and log-probabilities.
  - `block_stats`: Pallas pieces of the fused programs (per-block statistics, the top-k/top-p search
    from candidates, random numbers made inside a kernel).
  - `fused_sample`: `sample_tokens`' Pallas program (`kernels="pallas"`, the default on a GPU).
  - `sample`: `sample_tokens` and `process_logits`.

Processing order for a row (docs/api.md); steps 1-3 only when the request sets
them, and for greedy rows too:

    1. logits + logit_bias
    2. repetition penalty on every token of the context (prompt, generated
       tokens, earlier drafts of the round): x / r where x > 0, else x * r
    3. x -= frequency_penalty * count + presence_penalty * (count > 0), count of
       the token among the generated tokens (and earlier drafts; not the prompt)
    3b. with a `token_bitmask`: x = -inf where the mask disallows the token
    4. greedy: argmax. Random:
       logits / temperature -> keep top_k largest -> renormalise
                            -> keep the smallest most-likely set with mass >= top_p
                            -> renormalise
                            -> keep tokens with probability >= min_p * the largest
                            -> renormalise

All three filters are *threshold* filters: a token is kept iff its scaled logit
is >= a per-row threshold, so tokens tied with the last kept token are kept too.
Renormalising keeps probability ratios, so min-p's cut is `x / T >= max + log(min_p)`
on the scaled logits, and the kept set is `x / T >= max(top-k/top-p threshold, that)`.
Greedy requests (temperature below `GREEDY_TEMPERATURE`) use `argmax` of the
logits after steps 1-3, first index on ties.

Values outside the ordinary range, the same rule on every path (greedy, random,
filtered or not, alone or in any batch; a row never depends on its neighbours):

* NaN logits are masked tokens (as -inf): never emitted, never the argmax.
* +inf logits mean "this token": a row with +inf logits puts all its mass,
  uniformly, on them (after top-k/top-p, which keep all of them as a tie);
  greedy takes the first.
* A row with no logit above -inf (all masked or NaN) has no distribution:
  `process_logits` gives it all -inf, and the samplers emit token 0 there
  (greedy, random and mixed alike). Eager calls of `sample_tokens` raise instead.
* Finite logits never overflow: `logits / temperature` is computed as
  `(logits - row max) / temperature` for any row where the plain quotient is not
  finite (a temperature near 0, or logits near the float32 limit), so a
  temperature near 0 behaves like greedy for every finite logit. The shifted
  recomputation runs under a run-time `lax.cond`, only for batches that need it;
  other rows keep the one-pass results bit for bit.
* Steps 1-3 (`apply_penalties`) keep these classes: NaN stays NaN, +-inf stays
  +-inf (with finite biases and penalties), and a finite logit stays finite (a
  result beyond the float32 range saturates at +-3.4e38 instead of turning into
  "this token" or "masked").

Everything here is pure `jax.numpy` and works under `jit`; a "row" is one request
and every function broadcasts the per-request parameters over any middle axes.
"""

from specdec_jax.sampling.params import GREEDY_TEMPERATURE, SamplingParams, row_keys
from specdec_jax.sampling.penalties import PenaltyState, apply_penalties
from specdec_jax.sampling.sample import process_logits, sample_tokens

__all__ = [
  "GREEDY_TEMPERATURE",
  "PenaltyState",
  "SamplingParams",
  "apply_penalties",
  "process_logits",
  "row_keys",
  "sample_tokens",
]
