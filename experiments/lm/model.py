"""A decoder-only character transformer in Flax NNX, its sizes, and its pure ``(params, apply, loss_fn)`` form.

:class:`CharTransformer` is GPT-2-shaped (as nanoGPT): token and learned
position embeddings, ``n_layers`` pre-LayerNorm blocks (causal multi-head
self-attention, then a 4x GELU MLP, each added to the residual stream), a final
LayerNorm and a **separate** (untied) output head without bias.  No dropout.
Linear layers have biases; weights are initialised N(0, 0.02), the two
residual projections of each block N(0, 0.02 / sqrt(2 n_layers)), biases 0,
LayerNorms scale 1, bias 0.

Parameter tree (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``, the pytree
:func:`build` returns)::

    tok_embed/embedding            (vocab, d)
    pos_embed/embedding            (seq_len, d)
    blocks/<i>/ln1/{scale,bias}    (d,)             i = 0 .. n_layers - 1 (int keys: an nnx.List)
    blocks/<i>/attn/qkv/kernel     (d, 3d)          columns: q | k | v, heads contiguous within each
    blocks/<i>/attn/qkv/bias       (3d,)
    blocks/<i>/attn/proj/{kernel (d, d), bias (d,)}
    blocks/<i>/ln2/{scale,bias}    (d,)
    blocks/<i>/mlp/fc/{kernel (d, 4d), bias (4d,)}
    blocks/<i>/mlp/proj/{kernel (4d, d), bias (d,)}
    ln_f/{scale,bias}              (d,)
    head/kernel                    (d, vocab)

Each transformer block is one subtree ``params["blocks"][i]``, so methods that
synchronise parameters by fragment (Streaming DiLoCo: fragments strided over
blocks) can select them by path; :func:`block_index` maps a leaf's path to its
block (None for the embeddings, ``ln_f`` and ``head``).

Parameter count: ``vocab*d + seq_len*d + n_layers*(12 d^2 + 13 d) + 2d + d*vocab``
(per block: 2 LayerNorms 4d, qkv 3d^2+3d, proj d^2+d, MLP 8d^2+5d).  With the
65-character vocabulary, :data:`CONFIGS`:

- ``"default"`` (d 256, 4 layers, 8 heads, context 256): **3,258,368** parameters.
- ``"tiny"`` (d 64, 2 layers, 4 heads, context 64): **112,512** parameters,
  for CPU reproductions and tests.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from compjax import parallel

#: Model sizes by name: keyword arguments of :class:`CharTransformer` (besides ``vocab`` and ``rngs``).
CONFIGS = {
    "default": {"d_model": 256, "n_layers": 4, "n_heads": 8, "seq_len": 256},
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64},
}
#: Parameter counts of :data:`CONFIGS` for the 65-character Tiny Shakespeare vocabulary.
NUM_PARAMS = {"default": 3_258_368, "tiny": 112_512}

_STD = 0.02


def config(name: str | dict) -> dict:
    """The keyword arguments of a named size (a copy), or ``name`` itself if it is a dict (copied).

    Raises:
      ValueError: an unknown name.
    """
    if isinstance(name, dict):
        return dict(name)
    if name not in CONFIGS:
        raise ValueError(f"model config must be one of {sorted(CONFIGS)} or a dict, got {name!r}")
    return dict(CONFIGS[name])


def num_params(vocab: int, *, d_model: int, n_layers: int, seq_len: int, n_heads: int | None = None) -> int:
    """The parameter count of a :class:`CharTransformer`, from the formula in the module docstring."""
    d = d_model
    return vocab * d + seq_len * d + n_layers * (12 * d * d + 13 * d) + 2 * d + d * vocab


def _linear(din: int, dout: int, rngs: nnx.Rngs, *, std: float = _STD, bias: bool = True,
            dtype: Any = None) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=bias, kernel_init=nnx.initializers.normal(std),
                      bias_init=nnx.initializers.zeros_init(), dtype=dtype, rngs=rngs)


class CausalSelfAttention(nnx.Module):
    """Multi-head self-attention where position t attends to positions <= t.

    ``x`` (B, T, d) -> (B, T, d), float32; ``T`` may be anything.
    """

    def __init__(self, d_model: int, n_heads: int, *, resid_std: float, rngs: nnx.Rngs, dtype: Any = None):
        self.n_heads = n_heads
        self.qkv = _linear(d_model, 3 * d_model, rngs, dtype=dtype)
        self.proj = _linear(d_model, d_model, rngs, std=resid_std, dtype=dtype)

    def __call__(self, x):
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (y.reshape(b, t, h, d // h) for y in (q, k, v))
        scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, axis=-1), v)
        return self.proj(out.reshape(b, t, d))


class MLP(nnx.Module):
    """``proj(gelu(fc(x)))`` with a hidden width of ``4 d``."""

    def __init__(self, d_model: int, *, resid_std: float, rngs: nnx.Rngs, dtype: Any = None):
        self.fc = _linear(d_model, 4 * d_model, rngs, dtype=dtype)
        self.proj = _linear(4 * d_model, d_model, rngs, std=resid_std, dtype=dtype)

    def __call__(self, x):
        return self.proj(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``."""

    def __init__(self, d_model: int, n_heads: int, *, resid_std: float, rngs: nnx.Rngs, dtype: Any = None):
        self.ln1 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.attn = CausalSelfAttention(d_model, n_heads, resid_std=resid_std, rngs=rngs, dtype=dtype)
        self.ln2 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.mlp = MLP(d_model, resid_std=resid_std, rngs=rngs, dtype=dtype)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nnx.Module):
    """Decoder-only character transformer (see the module docstring for the layout and counts).

    Args:
      vocab: number of token ids (65 for Tiny Shakespeare).
      d_model: residual width; divisible by ``n_heads``.
      n_layers: transformer blocks (``self.blocks``, an ``nnx.List``).
      n_heads: attention heads per block.
      seq_len: the longest context (rows of the position embedding).
      rngs: initialisation randomness (``nnx.Rngs(seed)``).
      dtype: the compute dtype of every layer (None: that of the parameters,
        float32); the parameters are float32 either way.

    Call: ``model(ids)``, ids an integer array of shape ``(B, T)``, ``T <=
    seq_len``, returns logits of shape ``(B, T, vocab)`` (float32, or
    ``dtype``); the logits
    at position t depend only on ``ids[:, :t + 1]``.

    Raises:
      ValueError: ``d_model`` not divisible by ``n_heads``, or a size < 1;
        (at call time) ``T > seq_len``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from experiments.lm.model import CharTransformer, config
      >>> model = CharTransformer(65, **config("tiny"), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 10), jnp.int32)).shape
      (2, 10, 65)
      >>> sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
      112512
    """

    def __init__(self, vocab: int, *, d_model: int, n_layers: int, n_heads: int, seq_len: int, rngs: nnx.Rngs,
                 dtype: Any = None):
        if min(vocab, d_model, n_layers, n_heads, seq_len) < 1:
            raise ValueError(f"sizes must be >= 1: vocab={vocab} d_model={d_model} n_layers={n_layers} "
                             f"n_heads={n_heads} seq_len={seq_len}")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.seq_len = seq_len
        embed_init = nnx.initializers.normal(_STD)
        self.tok_embed = nnx.Embed(vocab, d_model, embedding_init=embed_init, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(seq_len, d_model, embedding_init=embed_init, dtype=dtype, rngs=rngs)
        resid_std = _STD / math.sqrt(2 * n_layers)
        self.blocks = nnx.List([Block(d_model, n_heads, resid_std=resid_std, rngs=rngs, dtype=dtype)
                                for _ in range(n_layers)])
        self.ln_f = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.head = _linear(d_model, vocab, rngs, bias=False, dtype=dtype)

    def __call__(self, ids):
        t = ids.shape[-1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context {self.seq_len}")
        x = self.tok_embed(ids) + self.pos_embed(jnp.arange(t))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def block_index(path) -> int | None:
    """The transformer block a parameter belongs to, from its pytree path; None outside the blocks.

    Args:
      path: a key path of the parameter pytree (from
        ``jax.tree_util.tree_leaves_with_path``), e.g. the path of
        ``params["blocks"][1]["attn"]["qkv"]["kernel"]``.

    Returns:
      ``i`` for leaves under ``blocks/<i>``, None for ``tok_embed``,
      ``pos_embed``, ``ln_f`` and ``head``.

    Examples:
      >>> import jax
      >>> from experiments.lm import model
      >>> params, _, _ = model.build("tiny")
      >>> sorted({model.block_index(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}, key=str)
      [0, 1, None]
    """
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if len(keys) >= 2 and keys[0] == "blocks":
        return int(keys[1])
    return None


#: ``fp32``: parameters and compute in float32.  ``mixed``: float32 (master) parameters, the model run on their
#: bfloat16 copy (:func:`compjax.parallel.compute_cast`: activations, matmuls and the gradient in bfloat16), the
#: logits and the loss in float32.
PRECISIONS = ("fp32", "mixed")


def build(model_config: str | dict = "tiny", vocab: int = 65, seed: int = 0, precision: str = "fp32"):
    """A :class:`CharTransformer` as ``(params, apply, loss_fn)`` on pure pytrees.

    Args:
      model_config: a name of :data:`CONFIGS` or a dict of the
        :class:`CharTransformer` keyword arguments.
      vocab: vocabulary size.
      seed: seeds the initialisation (``nnx.Rngs(seed)``).
      precision: one of :data:`PRECISIONS`; ``"mixed"`` runs the model on
        ``compjax.parallel.compute_cast(params)`` (bfloat16) and gives
        bfloat16 gradients of the float32 parameters.

    Returns:
      params: nested dict of float32 arrays (the layout of the module
        docstring).
      apply: ``(params, ids (B, T) int) -> logits (B, T, vocab) float32``; pure.
      loss_fn: ``(params, windows (..., T + 1) int) -> scalar``: mean
        next-character cross-entropy in nats (inputs ``windows[..., :-1]``,
        targets ``windows[..., 1:]``, every position counted once).

    Raises:
      ValueError: an unknown config name or ``precision``, or invalid sizes.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    net = CharTransformer(vocab, **config(model_config), rngs=nnx.Rngs(seed),
                          dtype=jnp.bfloat16 if precision == "mixed" else None)
    graphdef, state = nnx.split(net, nnx.Param)  # every Variable is a Param (no dropout, no RNG state)
    params = nnx.to_pure_dict(state)

    def apply(p, ids):
        if precision == "mixed":
            p = parallel.compute_cast(p)  # the bfloat16 compute copy; the gradient stays bfloat16
        s = nnx.State(state)  # a fresh container per call: tracing never mutates the template
        nnx.replace_by_pure_dict(s, p)
        return nnx.merge(graphdef, s)(ids).astype(jnp.float32)

    def loss_fn(p, windows):
        windows = windows.reshape(-1, windows.shape[-1])
        logits = apply(p, windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    return params, apply, loss_fn
