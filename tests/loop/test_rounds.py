"""Tests of the speculative round in specdec_jax/loop/: the positions it calls the models at, and its draft kinds.

`speculative_generate` checks P + max_new_tokens against a model's declared
`max_length` (its context). A row's last emitted token comes from position
P_b + max_new_tokens - 2, but a round's static shapes run K (or a tree's depth)
past the row's length; those drafts can never be emitted, and the loop must not
call a model at a position >= P + max_new_tokens for them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.drafts.dynamic_tree import DynamicTree
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.drafts.static_tree import DraftTree
from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.loop.draft_kinds import BlockDraft, DraftKind, FeatureDraft, LookupDraft, ModelDraft
from specdec_jax.models import Transformer, TransformerConfig
from specdec_jax.models.eagle import EagleDrafter
from specdec_jax.sampling.params import SamplingParams

V, P, K = 48, 5, 3

_LARGEST = {}  # model name -> the largest position it was called at


def _note(name, largest):
  _LARGEST[name] = max(_LARGEST.get(name, -1), int(largest))


class _Logged(nnx.Module):
  """A Transformer that declares the `max_length` it is given and notes the largest position of every call."""

  def __init__(self, inner, name: str, max_length: int):
    self.inner, self.name, self.declared = inner, name, max_length

  @property
  def config(self):
    return self.inner.config

  @property
  def max_length(self) -> int:
    return self.declared

  def init_cache(self, batch_size, max_length):
    return self.inner.init_cache(batch_size, max_length)

  def copy_cache_slots(self, cache, src, dst):
    return self.inner.copy_cache_slots(cache, src, dst)

  def _positions(self, args):
    return args[1]  # (tokens, positions, cache)

  def __call__(self, *args, **kw):
    jax.debug.callback(lambda m, name=self.name: _note(name, m), jnp.max(self._positions(args)))
    return self.inner(*args, **kw)


class _LoggedEagle(_Logged):
  """An EagleDrafter, logged the same way (it reads features: `fuse`, `feature_layers`)."""

  @property
  def feature_layers(self):
    return self.inner.feature_layers

  def fuse(self, features):
    return self.inner.fuse(features)

  def _positions(self, args):
    return args[2]  # (tokens, hidden, positions, cache)


@pytest.fixture(scope="module")
def models():
  config = TransformerConfig.tiny(V, feature_layers=(0, 1))
  target = Transformer(config, rngs=nnx.Rngs(0))
  draft = Transformer(config.replace(num_layers=1, feature_layers=()), rngs=nnx.Rngs(1))
  eagle = EagleDrafter.for_target(target, rngs=nnx.Rngs(2))
  return target, {"model": draft, "eagle": eagle}


# max_new_tokens=2: one round, which starts with room for one token; every draft past it is beyond the end.
@pytest.mark.parametrize(
  "drafter,tree,max_new",
  [
    ("model", None, 2),
    ("lookup", None, 2),
    ("eagle", None, 2),
    ("model", (2, 1, 1), 2),
    ("lookup", DraftTree((2, 1, 1)), 2),
    ("eagle", (2, 1, 1), 2),
    ("model", DynamicTree(K, 2, 4), 2),
    ("eagle", DynamicTree(K, 2, 4), 2),
    ("model", None, 9),
    ("eagle", None, 9),
    ("eagle", DynamicTree(K, 2, 4), 9),
  ],
)
def test_no_model_is_called_past_the_context_it_declares(models, drafter, tree, max_new):
  target, drafters = models
  end = P + max_new  # the context each model declares: just enough for the request
  logged_target = _Logged(target, "target", end)
  if drafter == "lookup":
    draft = PromptLookupDrafter(2)
  else:
    draft = (_LoggedEagle if drafter == "eagle" else _Logged)(drafters[drafter], "draft", end)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, 8, size=(2, P)), jnp.int32)
  lengths = jnp.array([P, 3], jnp.int32)  # the full-width row reaches the last positions
  params = SamplingParams.greedy(2)
  _LARGEST.clear()
  out = speculative_generate(
    logged_target,
    draft,
    prompts,
    lengths,
    params,
    None,
    max_new_tokens=max_new,
    num_speculative_tokens=K,
    all_greedy=True,
    draft_tree=tree,
  )
  jax.effects_barrier()
  assert _LARGEST["target"] < end, f"the target was called at position {_LARGEST['target']} >= {end}"
  if drafter != "lookup":
    assert _LARGEST["draft"] < end, f"the drafter was called at position {_LARGEST['draft']} >= {end}"
  # Positions past the end belong to drafts that are dropped: the tokens are generate's.
  plain = generate(target, prompts, lengths, params, None, max_new_tokens=max_new, all_greedy=True)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  assert int(out.lengths[0]) == max_new


def test_every_draft_kind_follows_the_protocol():
  for kind in (ModelDraft, LookupDraft, FeatureDraft, BlockDraft):
    for name in (
      "needs_features",
      "start",
      "propose_chain",
      "propose_tree",
      "propose_dynamic",
      "commit_tree",
      "observe",
    ):
      assert hasattr(kind, name), f"{kind.__name__} lacks {name} of DraftKind"
  assert issubclass(DraftKind, object) and DraftKind.__name__ == "DraftKind"


def test_prompt_lookup_refuses_a_dynamic_tree_at_trace_time():
  with pytest.raises(TypeError, match="prompt lookup has none"):
    LookupDraft(PromptLookupDrafter(2), K).propose_dynamic(
      None, None, None, None, tree=DynamicTree(K, 2, 4), all_greedy=True, max_length=32, end=P + 2
    )
