"""The demo's prompts with the EAGLE head: plain decoding against chains, static and dynamic trees (greedy).

For the CPU question of the EAGLE issue (can the head beat plain decoding on the
demo's chat and code prompts?): each prompt in one process, every draft shape
compiled first and timed 3 times (median), outputs checked against plain
greedy. Shapes: "K=2" (a chain), "(2, 1)" (a static tree), "d3x3x6" (a dynamic
tree: depth, top-k, nodes).

    PYTHONPATH=. python bench/demo_trees.py chat code          # results in bench/RESULTS.md, CPU section
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from examples.speculative_decode import PROMPTS  # noqa: E402
from specdec_jax import generate, speculative_generate  # noqa: E402
from specdec_jax.drafts.dynamic_tree import DynamicTree  # noqa: E402
from specdec_jax.models import load_smollm2, load_smollm2_eagle  # noqa: E402
from specdec_jax.models.loaders.smollm2 import SMOLLM2_EOS_IDS, encode_prompts  # noqa: E402
from specdec_jax.sampling.params import SamplingParams  # noqa: E402

SHAPES = [("K=2", 2, None), ("(2, 1)", 2, (2, 1)), ("d2x2x3", 2, DynamicTree(2, 2, 3)),
          ("d2x3x4", 2, DynamicTree(2, 3, 4)), ("d3x2x4", 3, DynamicTree(3, 2, 4)), ("d3x3x6", 3, DynamicTree(3, 3, 6))]


def _timed(fn, repeats=3):
  """(the output of fn(), the median wall seconds of `repeats` calls after a compiling call)."""
  out = jax.block_until_ready(fn())  # compile
  return out, statistics.median(common.time_call(fn, repeats=repeats))


def main(names):
  bad = [n for n in names if n not in PROMPTS]
  if bad:
    sys.exit(f"unknown prompt(s) {bad}; choose from {list(PROMPTS)}")
  target, tokenizer = load_smollm2(jnp.float32)
  eagle = load_smollm2_eagle(jnp.float32)
  kw = dict(max_new_tokens=48, eos_token_id=SMOLLM2_EOS_IDS, all_greedy=True)
  params = SamplingParams.greedy(1)
  for name in names:
    tokens, lengths = (jnp.asarray(x) for x in encode_prompts(tokenizer, [PROMPTS[name][0]]))
    plain, t_plain = _timed(lambda: generate(target, tokens, lengths, params, None, **kw))
    rate = int(plain.lengths[0]) / t_plain
    print(f"{name}: plain {rate:.1f} tok/s", flush=True)
    for label, k, tree in SHAPES:
      out, t = _timed(lambda: speculative_generate(target, eagle, tokens, lengths, params, None,
                                                   num_speculative_tokens=k, draft_tree=tree, **kw))
      same = np.array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
      print(f"  {label:8s} {int(out.lengths[0]) / t:6.1f} tok/s  x{int(out.lengths[0]) / t / rate:.2f}  "
            f"mean accepted length {float(out.stats.mean_accepted_length):.2f}  same as plain: {same}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:] or ["chat", "code"])
