"""Plugging your own model into `generate` and `speculative_generate`.

Run:  python examples/custom_model.py          (CPU, about 15 s, most of it compilation)

The decoding loops see a model only through two methods (docs/models.md):

    cache = model.init_cache(batch_size, max_length)
    logits, cache = model(tokens, positions, cache)    # int32 [B, T] x2 -> float [B, T, V]

This file writes a model that is *not* the project's Transformer, and not even
attention: a tiny recurrent network, h_p = tanh(E[token_p] + h_{p-1} @ W). Its
cache holds the hidden state after every position, one slot per position:

    slot:    0     1     2     3     4  ...
    cache:   h_0   h_1   h_2   h_3   .          h_p = state after the token at position p
    call with tokens [a, b] at positions [3, 4]: reads slot 2, writes slots 3 and 4

That is all the loop asks of a cache: a token at position p writes slot p, the
logits at p depend only on slots <= p, and writes outside [0, max_length) are
dropped. A rejected draft needs no undo: its slots lie past the row's length,
and the next round writes them again before anything reads them.

The model is a registered pytree of arrays, so the loops pass its weights
through `jit` as arguments (new weights of the same shapes do not recompile).
The draft is a noisy copy of the target (the same class), so it agrees with the
target only part of the time; prompt lookup needs no draft model at all.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import PromptLookupDrafter, SamplingParams, generate, speculative_generate

VOCAB, HIDDEN = 64, 48


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TinyRNN:
  """A one-layer recurrent language model that follows the model protocol.

  Attributes:
    embed: f32[V, H] token embeddings (added to the state).
    recur: f32[H, H] state-to-state weights.
    unembed: f32[H, V] output projection.
  """

  embed: jax.Array  # [V, H]
  recur: jax.Array  # [H, H]
  unembed: jax.Array  # [H, V]

  @classmethod
  def random(cls, seed: int, vocab_size: int = VOCAB, hidden: int = HIDDEN) -> "TinyRNN":
    """Random weights; large enough that the greedy text is not constant."""
    r = np.random.default_rng(seed)
    return cls(
      embed=jnp.asarray(r.normal(0, 1.0, (vocab_size, hidden)), jnp.float32),
      recur=jnp.asarray(r.normal(0, 0.6 / np.sqrt(hidden), (hidden, hidden)), jnp.float32),
      unembed=jnp.asarray(r.normal(0, 4.0 / np.sqrt(hidden), (hidden, vocab_size)), jnp.float32),
    )

  def noisy_copy(self, seed: int, scale: float) -> "TinyRNN":
    """The same model with every weight perturbed by `scale` times its own spread."""
    r = np.random.default_rng(seed)
    noise = lambda w: w + jnp.asarray(r.normal(0, scale * float(jnp.std(w)), w.shape), jnp.float32)
    return TinyRNN(embed=noise(self.embed), recur=noise(self.recur), unembed=noise(self.unembed))

  # --- the model protocol ----------------------------------------------------

  def init_cache(self, batch_size: int, max_length: int) -> jax.Array:
    """f32[B, S, H]: the state after each position (zeros = nothing written yet)."""
    return jnp.zeros((batch_size, max_length, self.recur.shape[0]), jnp.float32)

  def __call__(self, tokens: jax.Array, positions: jax.Array, cache: jax.Array):
    """Runs the recurrence over T tokens per row, each at its own position.

    Args:
      tokens: int32[B, T]; ids outside [0, V) (the loop never sends them) are clipped.
      positions: int32[B, T], consecutive within a row (the loops always send
        consecutive positions: a prefill, one token, or K+1 tokens to verify).
      cache: f32[B, S, H] from `init_cache`.

    Returns:
      (logits f32[B, T, V], the cache with slots `positions` written).
    """
    b, t = tokens.shape
    s = cache.shape[1]
    rows = jnp.arange(b)
    x = self.embed[jnp.clip(tokens, 0, self.embed.shape[0] - 1)]  # [B, T, H]
    # The state before the first token: slot p-1, or zeros at position 0. This is
    # the only read of the cache, and it is a slot < p.
    before = positions[:, 0] - 1
    h0 = cache[rows, jnp.clip(before, 0, s - 1)]
    h0 = jnp.where((before >= 0)[:, None], h0, 0.0)

    def step(h, xt):
      h = jnp.tanh(xt + h @ self.recur)
      return h, h

    _, hs = jax.lax.scan(step, h0, jnp.swapaxes(x, 0, 1))  # [T, B, H]
    hs = jnp.swapaxes(hs, 0, 1)  # [B, T, H]
    # Write each state at its own position; out-of-range positions go to slot s,
    # which mode="drop" discards (never clamped onto a valid slot).
    slots = jnp.where((positions >= 0) & (positions < s), positions, s)
    cache = cache.at[rows[:, None], slots].set(hs, mode="drop")
    return hs @ self.unembed, cache


def make_prompts(seed: int, lengths, p: int):
  """Right-padded random prompts int32[B, P] (with a repeated stretch) and their lengths."""
  r = np.random.default_rng(seed)
  tokens = np.zeros((len(lengths), p), np.int32)
  for row, n in enumerate(lengths):
    stretch = r.integers(0, VOCAB, 6)
    text = np.concatenate([stretch, r.integers(0, VOCAB, 2), stretch])  # prompt lookup can copy this
    tokens[row, :n] = np.resize(text, n)
  return jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)


def main(max_new_tokens: int = 48, k: int = 4) -> dict:
  """Runs plain and speculative decoding with `TinyRNN`; returns what it checked."""
  target = TinyRNN.random(seed=0)
  draft = target.noisy_copy(seed=1, scale=0.15)
  prompts, lengths = make_prompts(seed=0, lengths=[14, 9, 12], p=14)
  b = prompts.shape[0]
  greedy = SamplingParams.greedy(b)
  results = {}

  def run(name, fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    st = out.stats
    print(
      f"{name:34s} {int(jnp.sum(out.lengths)):4d} tokens  acceptance {float(st.acceptance_rate):.2f}  "
      f"tokens/target call {float(st.mean_accepted_length):.2f}  ({time.perf_counter() - start:.1f} s incl. "
      f"compile)"
    )
    return out

  plain = run(
    "generate (greedy)",
    lambda: generate(target, prompts, lengths, greedy, None, max_new_tokens=max_new_tokens, all_greedy=True),
  )
  print("  row 0:", np.asarray(plain.tokens[0, : plain.lengths[0]]).tolist())

  same = True
  for name, drafter in (("draft model (noisy copy)", draft), ("prompt lookup", PromptLookupDrafter((3, 2)))):
    out = run(
      f"speculative, {name}, K={k}",
      lambda: speculative_generate(
        target,
        drafter,
        prompts,
        lengths,
        greedy,
        None,
        max_new_tokens=max_new_tokens,
        num_speculative_tokens=k,
        all_greedy=True,
      ),
    )
    print(f"  accepted drafts by position: {np.asarray(out.stats.accepted_per_position).tolist()}")
    equal = bool(np.array_equal(np.asarray(out.tokens), np.asarray(plain.tokens)))
    print(f"  greedy output equals generate's: {equal}")
    same &= equal
    results[name] = {
      "acceptance_rate": float(out.stats.acceptance_rate),
      "mean_accepted_length": float(out.stats.mean_accepted_length),
    }

  # Sampled rows: the tokens differ from any other run, but their distribution is the target's.
  # (top_k= and top_p= work the same way; they add a threshold search to the program.)
  sampled = SamplingParams.create([0.8, 1.0, 0.6])
  out = run(
    f"speculative, sampled, K={k}",
    lambda: speculative_generate(
      target,
      draft,
      prompts,
      lengths,
      sampled,
      jax.random.key(0),
      max_new_tokens=max_new_tokens,
      num_speculative_tokens=k,
    ),
  )
  print("  row 0:", np.asarray(out.tokens[0, : out.lengths[0]]).tolist())

  print("\nCHECK greedy speculative == greedy generate:", "OK" if same else "FAILED")
  results["greedy_equal"] = same
  return results


if __name__ == "__main__":
  if not main()["greedy_equal"]:
    raise SystemExit(1)
