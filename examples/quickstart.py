"""A first look at `specdec_jax.rejection_sample` on a greedy, a random and a mixed batch.

Run:  python examples/quickstart.py

A toy target over a 12-token vocabulary scores K=4 draft tokens per request; the
sampler keeps the longest prefix the target agrees with and emits one more token.
The greedy and n-gram batches use fixed drafts; the T=1 batch samples its drafts
from the draft distribution `draft_probs` it passes, as a draft model would.
"""

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import PLACEHOLDER_TOKEN_ID, SamplingParams, rejection_sample

B, K, V = 4, 4, 12


def show(title, draft, out, params, n=(K,) * B):
  print(f"\n== {title}")
  for b in range(B):
    t = float(params.temperature[b])
    kind = "greedy" if t == 0 else f"T={t:g}"
    emitted = [int(x) for x in out.token_ids[b] if x != PLACEHOLDER_TOKEN_ID]
    n_acc = int(out.num_accepted[b])
    print(
      f"  row {b} ({kind:6s}) drafts {list(map(int, draft[b][: n[b]]))} -> emitted {emitted}"
      f"  (accepted {n_acc} of {n[b]}, then {'bonus' if n_acc == n[b] else 'recovered'} {emitted[-1]})"
    )


def main():
  rng = np.random.default_rng(0)
  target_logits = jnp.asarray(3.0 * rng.normal(size=(B, K + 1, V)), jnp.float32)  # [B, K+1, V]
  argmax = np.asarray(jnp.argmax(target_logits, axis=-1))
  # Drafts that agree with the target's argmax for a row-dependent number of steps.
  draft = argmax[:, :K].copy()
  for b in range(B):
    if b < K:
      draft[b, b] = (draft[b, b] + 1) % V
  draft = jnp.asarray(draft, jnp.int32)  # [B, K]
  key = jax.random.key(42)

  greedy = SamplingParams.greedy(B)
  show(
    "greedy batch (all_greedy=True: no softmax, no random numbers)",
    draft,
    rejection_sample(draft, target_logits, greedy, key, all_greedy=True),
    greedy,
  )

  # At T=1 the sampler is lossless only if each draft token was drawn from the
  # draft distribution passed beside it: here a noisy copy of the target's
  # distribution stands in for a draft model, and the drafts are sampled from it.
  random = SamplingParams.create(jnp.ones(B))
  draft_probs = jax.nn.softmax(target_logits[:, :K] + jnp.asarray(rng.normal(size=(B, K, V)), jnp.float32))
  key, draft_key = jax.random.split(key)
  sampled_draft = jax.random.categorical(draft_key, jnp.log(draft_probs), axis=-1).astype(jnp.int32)  # [B, K]
  show(
    "random batch, T=1, drafts sampled from draft_probs",
    sampled_draft,
    rejection_sample(sampled_draft, target_logits, random, key, draft_probs=draft_probs),
    random,
  )

  mixed = SamplingParams.create([0.0, 0.7, 0.0, 1.0], top_k=[0, 5, 0, 0], top_p=[1.0, 1.0, 1.0, 0.9])
  n = (4, 3, 2, 0)
  # Drafts without probabilities (n-gram / prompt lookup) count as certain
  # guesses (draft_probs=None), so any tokens may be passed.
  show(
    "mixed batch, n-gram drafts (no probabilities), ragged lengths [4, 3, 2, 0]",
    draft,
    rejection_sample(draft, target_logits, mixed, key, num_draft_tokens=jnp.array(n)),
    mixed,
    n,
  )


if __name__ == "__main__":
  main()
