"""A decoder-only transformer LM annotated for ``(data, fsdp, tensor)`` meshes, and its own jitted train step.

This is the shape of the models the field trains with tensor parallelism
(Flax's LM examples, MaxText): every parameter is created through
``nnx.with_partitioning`` under **logical** axis names (``"vocab"``,
``"embed"``, ``"heads"``, ``"kv"``, ``"mlp"``), and a table of rules
(:data:`RULES`) maps them to mesh axes: ``embed -> fsdp``, ``mlp``,
``heads`` and ``vocab`` ``-> tensor``.  The model:

- token embedding by gather (``nnx.Embed``, ``(vocab, embed)``) plus a learned
  position embedding (``(seq, embed)``, its rows whole);
- ``n_layers`` pre-LayerNorm blocks: causal multi-head attention (query, key
  and value kernels ``(embed, heads, kv)``, output ``(heads, kv, embed)``),
  then an MLP ``(embed, mlp)`` / ``(mlp, embed)`` with GELU, each followed by
  dropout (rate :attr:`Config.dropout`) and added to the residual stream;
- a final LayerNorm and an **untied** output projection ``(embed, vocab)``.

:func:`make_train_step` writes the step as those programs do:
``jax.jit(train_step, in_shardings=..., out_shardings=..., static_argnums=...,
donate_argnums=...)`` over ``(params, opt_state, batch, dropout_key, config)``
where ``config`` (a frozen :class:`Config`) is a static argument.

Parameter count (:func:`num_params`): ``vocab*d + seq*d + n_layers*(4 d^2 +
2 d f + 4 d) + 2 d + d*vocab`` with ``d = embed``, ``f = mlp`` (attention
kernels ``4 d^2`` without biases, the MLP ``2 d f`` without biases, two
LayerNorms ``4 d``).  :data:`CONFIGS` holds a tiny size for tests and the 8B
and 70B shapes (Llama-3 widths, vocabulary and sequence length shortened to
what the memory benchmark compiles) for abstract memory measurements.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

#: Logical axis name -> mesh axis (None: not sharded), as Flax's LM examples and MaxText write them.
RULES = (
    ("batch", "data"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("seq", None),
)


@dataclasses.dataclass(frozen=True)
class Config:
    """The LM's sizes (frozen, hashable: the train step's static argument).

    Attributes:
      vocab: token ids.
      embed: residual width ``d``; ``heads * head_dim``.
      heads: attention heads.
      head_dim: width of each head (``kv``).
      mlp: hidden width of the MLP.
      n_layers: transformer blocks.
      seq_len: the longest context (rows of the position embedding).
      dropout: dropout rate after attention and the MLP, in [0, 1).
    """

    vocab: int = 64
    embed: int = 32
    heads: int = 4
    head_dim: int = 8
    mlp: int = 64
    n_layers: int = 2
    seq_len: int = 16
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("vocab", "embed", "heads", "head_dim", "mlp", "n_layers", "seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Config.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.heads * self.head_dim != self.embed:
            raise ValueError(f"Config: heads * head_dim must equal embed, got {self.heads} * {self.head_dim} != "
                             f"{self.embed}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Config.dropout must be in [0, 1), got {self.dropout!r}")


#: Sizes by name.  ``"tiny"`` for tests; ``"8b"`` and ``"70b"`` have Llama-3's widths and depths (the
#: vocabulary and context shortened) for abstract memory measurements only.
CONFIGS = {
    "tiny": Config(),
    "8b": Config(vocab=128_256, embed=4096, heads=32, head_dim=128, mlp=14_336, n_layers=32, seq_len=2048),
    "70b": Config(vocab=128_256, embed=8192, heads=64, head_dim=128, mlp=28_672, n_layers=80, seq_len=2048),
}


def num_params(cfg: Config) -> int:
    """The parameter count of :class:`TransformerLM` for ``cfg`` (the module docstring's formula)."""
    d, f = cfg.embed, cfg.mlp
    return cfg.vocab * d + cfg.seq_len * d + cfg.n_layers * (4 * d * d + 2 * d * f + 4 * d) + 2 * d + d * cfg.vocab


_init = nnx.initializers.normal(0.02)


def _param(rngs: nnx.Rngs, shape: tuple, names: tuple, init=_init) -> nnx.Param:
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape))


class _LayerNorm(nnx.Module):
    def __init__(self, d: int):
        self.scale = nnx.Param(jnp.ones((d,)), out_sharding=("embed",))
        self.bias = nnx.Param(jnp.zeros((d,)), out_sharding=("embed",))

    def __call__(self, x):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-6) * self.scale[...] + self.bias[...]


class Attention(nnx.Module):
    """Causal multi-head self-attention: ``(B, T, embed) -> (B, T, embed)``; position t sees positions <= t."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        shape, names = (cfg.embed, cfg.heads, cfg.head_dim), ("embed", "heads", "kv")
        self.query = _param(rngs, shape, names)
        self.key = _param(rngs, shape, names)
        self.value = _param(rngs, shape, names)
        self.out = _param(rngs, (cfg.heads, cfg.head_dim, cfg.embed), ("heads", "kv", "embed"))

    def __call__(self, x):
        q = jnp.einsum("btd,dhk->bthk", x, self.query[...])
        k = jnp.einsum("btd,dhk->bthk", x, self.key[...])
        v = jnp.einsum("btd,dhk->bthk", x, self.value[...])
        t = x.shape[1]
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
        ctx = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v)
        return jnp.einsum("bqhk,hkd->bqd", ctx, self.out[...])


class Block(nnx.Module):
    """Pre-LayerNorm block: ``x + drop(attn(ln1(x)))``, then ``+ drop(mlp(ln2(.)))``."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.ln1, self.ln2 = _LayerNorm(cfg.embed), _LayerNorm(cfg.embed)
        self.attn = Attention(cfg, rngs)
        self.wi = _param(rngs, (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.wo = _param(rngs, (cfg.mlp, cfg.embed), ("mlp", "embed"))
        self.drop = nnx.Dropout(cfg.dropout)

    def __call__(self, x, rngs):
        x = x + self.drop(self.attn(self.ln1(x)), rngs=rngs)
        h = jax.nn.gelu(self.ln2(x) @ self.wi[...]) @ self.wo[...]
        return x + self.drop(h, rngs=rngs)


class TransformerLM(nnx.Module):
    """Decoder-only transformer LM with logical-axis annotations (see the module docstring).

    Args:
      cfg: the sizes.
      rngs: initialisation randomness (``nnx.Rngs(seed)``).

    Call: ``model(ids, rngs=None)``, ``ids`` int ``(B, T)``, ``T <= seq_len``;
    returns float32 logits ``(B, T, vocab)``.  Dropout draws from ``rngs``
    (an ``nnx.Rngs`` with a ``dropout`` stream) when ``cfg.dropout > 0``.

    Examples:
      >>> import jax
      >>> from flax import nnx
      >>> from experiments.lm.sharded import CONFIGS, abstract, num_params
      >>> model = abstract(CONFIGS["tiny"])     # shapes only, annotations kept, nothing allocated
      >>> model.blocks[0].wi.shape, nnx.get_partition_spec(model.blocks[0].wi).get_value()
      ((32, 64), P('embed', 'mlp'))
      >>> sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == num_params(CONFIGS["tiny"])
      True
    """

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.tok_embed = nnx.Embed(cfg.vocab, cfg.embed, rngs=rngs,
                                   embedding_init=nnx.with_partitioning(_init, ("vocab", "embed")))
        self.pos_embed = _param(rngs, (cfg.seq_len, cfg.embed), ("seq", "embed"))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = _LayerNorm(cfg.embed)
        self.head = _param(rngs, (cfg.embed, cfg.vocab), ("embed", "vocab"))
        self.drop = nnx.Dropout(cfg.dropout)

    def __call__(self, ids, rngs=None):
        t = ids.shape[-1]
        if t > self.cfg.seq_len:
            raise ValueError(f"ids: a sequence of {t} tokens is longer than the context seq_len={self.cfg.seq_len}")
        x = self.tok_embed(ids) + self.pos_embed[...][:t]
        x = self.drop(x, rngs=rngs)
        for block in self.blocks:
            x = block(x, rngs)
        return (self.ln_f(x) @ self.head[...]).astype(jnp.float32)


def init(cfg: Config, seed: int = 0) -> tuple[nnx.GraphDef, dict]:
    """The model's graph definition and its float32 parameters as a pure dict (held on one device, whole).

    Variables are created without eager sharding: place them with :func:`param_specs` (the annotations under
    :data:`RULES`) on the mesh of your choice.
    """
    with nnx.use_eager_sharding(False):
        model = TransformerLM(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


def abstract(cfg: Config) -> TransformerLM:
    """The model with ``jax.ShapeDtypeStruct`` values (nothing allocated): shapes, counts, annotations."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))


def param_specs(cfg: Config, rules: tuple = RULES, mesh: Mesh | None = None) -> dict:
    """The parameters' ``PartitionSpec`` under ``rules`` (mesh axes a ``mesh`` lacks, or of size 1, dropped).

    Returns:
      A dict with the structure of :func:`init`'s parameters, one ``PartitionSpec`` per leaf.
    """
    with nnx.logical_axis_rules(rules):
        specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(abstract(cfg), nnx.Param)))
    if mesh is None:
        return specs
    keep = {a for a in mesh.axis_names if mesh.shape[a] > 1}

    def trim(entry):
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in keep)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return jax.tree.map(lambda s: P(*(trim(e) for e in s)), specs, is_leaf=lambda x: isinstance(x, P))


def loss_fn(graphdef: nnx.GraphDef, params: dict, windows: jax.Array, key: jax.Array | None, cfg: Config):
    """Mean next-token cross-entropy (nats) of ``windows`` int ``(B, T + 1)``; dropout keyed by ``key``."""
    model = nnx.merge(graphdef, nnx.State(params))
    rngs = nnx.Rngs(dropout=key) if (key is not None and cfg.dropout > 0) else None
    logits = model(windows[:, :-1], rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, param_shardings: Any = None,
                    opt_shardings: Any = None, batch_sharding: Any = None, donate: bool = True):
    """The program's own train step: ``jax.jit`` with shardings, a static config and donated state.

    ``step(params, opt_state, batch, dropout_key, cfg) -> (params, opt_state, loss)``: one AdamW-or-other
    step of ``tx`` on the mean next-token loss of ``batch`` (int ``(B, T + 1)``).  ``cfg`` (argument 4) is
    static; ``params`` and ``opt_state`` (arguments 0 and 1) are donated when ``donate``.

    Args:
      graphdef: from :func:`init`.
      tx: the optimizer (a compjax compressor may lead its chain).
      param_shardings, opt_shardings, batch_sharding: ``NamedSharding`` trees for ``in_shardings`` /
        ``out_shardings`` (None: left to JAX).
      donate: donate the parameters and the optimizer state.

    Returns:
      The jitted step.
    """

    def train_step(params, opt_state, batch, dropout_key, cfg):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch, dropout_key, cfg))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    kw = {}
    if param_shardings is not None or opt_shardings is not None or batch_sharding is not None:
        kw = {"in_shardings": (param_shardings, opt_shardings, batch_sharding, None),
              "out_shardings": (param_shardings, opt_shardings, None)}
    return jax.jit(train_step, static_argnums=(4,), donate_argnums=(0, 1) if donate else (), **kw)


def shardings(mesh: Mesh, tree_of_specs: Any) -> Any:
    """``NamedSharding(mesh, spec)`` for every ``PartitionSpec`` of a tree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree_of_specs, is_leaf=lambda x: isinstance(x, P))
