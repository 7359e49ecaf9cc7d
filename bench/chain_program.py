"""Does a change leave the chain path's program alone? Compare a Transformer call's lowered program across checkouts.

Lowers `Transformer.__call__(tokens, positions, cache)` (a chain call: no
tree arguments, no features) for a model of SmolLM2-135M's shape, and
`EagleDrafter.__call__(tokens, hidden, positions, cache)` for a 2-block head
on it, at a few (B, T), and writes each lowered StableHLO module (without debug information,
so it is the same text on any backend) to a JSON file. Run it in two
checkouts and compare: equal text means the same program, so the same cost on
every device, by construction.

    (cd old_checkout && PYTHONPATH=. python /path/to/bench/chain_program.py --out /tmp/old.json)
    PYTHONPATH=. python bench/chain_program.py --out /tmp/new.json --compare /tmp/old.json

Runs on a CPU in about a minute (lowering only, nothing is compiled or run).
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp
from flax import nnx

from specdec_jax.models import Transformer, TransformerConfig
from specdec_jax.models.eagle import EagleDrafter

# SmolLM2's shape written out here rather than imported from another bench script: this script also runs
# against older checkouts, whose bench/ may lack what today's has.
SMOLLM2 = dict(
  vocab_size=49152, num_layers=30, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64, d_ff=1536, rope_theta=1e5
)
SHAPES = ((1, 1), (1, 5), (8, 5))  # (B, T): a decode step and verification calls


def lowered_programs(cache_len: int = 64) -> dict[str, str]:
  """{"B{b}T{t}": lowered StableHLO text} of chain calls, float32, random weights."""
  model = Transformer(TransformerConfig(**SMOLLM2, dtype=jnp.float32), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  call = jax.jit(lambda state, tokens, positions, cache: nnx.merge(graphdef, state)(tokens, positions, cache))
  # The EAGLE drafter (2 blocks, reading blocks 2, 15 and 27) on hiddens of the target's width.
  drafter = EagleDrafter.for_target(
    Transformer(TransformerConfig(**SMOLLM2, dtype=jnp.float32, feature_layers=(2, 15, 27)), rngs=nnx.Rngs(0)),
    num_layers=2,
    rngs=nnx.Rngs(1),
  )
  d_graphdef, d_state = nnx.split(drafter)
  d_call = jax.jit(
    lambda state, tokens, hidden, positions, cache: nnx.merge(d_graphdef, state)(tokens, hidden, positions, cache)
  )
  out = {}
  for b, t in SHAPES:
    tokens = jnp.zeros((b, t), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + 10, (b, t))
    text = call.lower(state, tokens, positions, model.init_cache(b, cache_len)).as_text(debug_info=False)
    out[f"B{b}T{t}"] = re.sub(r"\s+", " ", text)
    hidden = jnp.zeros((b, t, SMOLLM2["d_model"]), jnp.float32)
    text = d_call.lower(d_state, tokens, hidden, positions, drafter.init_cache(b, cache_len)).as_text(debug_info=False)
    out[f"eagle B{b}T{t}"] = re.sub(r"\s+", " ", text)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="JSON file for this checkout's programs")
  ap.add_argument("--compare", help="a JSON file written by another checkout: report which programs are equal")
  args = ap.parse_args(argv)
  programs = lowered_programs()
  with open(args.out, "w") as f:
    json.dump(programs, f)
  print(f"wrote {args.out}: " + ", ".join(f"{k} {len(v)} chars" for k, v in programs.items()))
  if args.compare:
    with open(args.compare) as f:
      other = json.load(f)
    same = {k: other.get(k) == v for k, v in programs.items()}
    for k, eq in same.items():
      print(f"  {k}: {'the same program' if eq else 'DIFFERENT'}")
    return same
  return None


if __name__ == "__main__":
  main()
