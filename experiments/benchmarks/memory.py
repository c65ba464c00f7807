"""Per-device memory of the LM training step from 125M to 65B parameters: compjax's layouts beside a MaxText-style step.

    python -m experiments.benchmarks.memory [--sizes 125M,1B,8B,70B] [--meshes 2x4,2x8,2x32,2x2x2,2x4x2]
        [--methods dense,topk,...] [--precision mixed|fp32] [--no-reference]
    python -m experiments.benchmarks.memory --publish     # the committed results (experiments/results/benchmarks)

Every configuration is compiled ahead of time from abstract inputs
(``jax.ShapeDtypeStruct`` with a ``NamedSharding``: nothing is allocated) on a
``slow x fast`` mesh of simulated CPU devices (``parallel.make_2d_mesh(slow, fast)``:
``slow`` hosts of ``fast`` devices, FSDP over the fast axis) or on a
``data x fsdp x tensor`` mesh (``2x2x2``: ``data`` hosts of ``fsdp x tensor``
devices, every parameter laid out by logical-axis rules as MaxText and Flax's
LM examples annotate it: :func:`tensor_specs`), and XLA's buffer assignment of
the compiled step is read back (``compiled.memory_analysis()``, bytes of one
device's program).
The script asks XLA for :data:`MAX_DEVICES` simulated devices before JAX starts.

**Model**: the LM testbed's transformer (:class:`experiments.lm.model.CharTransformer`:
GPT-2 shaped, learned positions, pre-LayerNorm blocks, 4x GELU MLP, untied
head) with a 32,000-token vocabulary and a 1,024-token context (:data:`SIZES`:
0.13B, 1.04B, 7.92B and, as the 70B class, 64.97B parameters: 80 layers, d 8192,
64 heads), written here in pure JAX with the same leaves and parameter
count (:func:`experiments.lm.model.num_params`, checked) but each block
parameter stacked over the layers and the blocks run under ``jax.lax.scan``
with activation checkpointing (:func:`forward`): the testbed's model unrolls
its blocks and its compiled step grows with the number of leaves (its 2-block
``tiny`` config took 9-39 s per configuration to compile on the shared 2-core
machine; 38 unrolled blocks of 16 leaves each would not fit the 10 minutes the
whole benchmark may take).  Compressors therefore see each stacked leaf (all
the layers of a group, :func:`init_shapes`) as one layer.

**Precision** (``--precision``, :data:`PRECISIONS`): ``mixed`` (the default and
the published table: float32 master parameters, float32 AdamW moments and
float32 compressor / error-feedback / DiLoCo state; the loss casts each
parameter to bfloat16 where it is used, so activations, the matmuls and the
gathered compute copies are bfloat16; the cast is
:func:`compjax.parallel.compute_cast`, so the gradient stays bfloat16, 2 bytes
per parameter, and reaches the optimizer so: error feedback accumulates it into
its float32 residual, AdamW into its float32 moments, ``cj.identity`` sends it
in bfloat16) or ``fp32`` (everything float32).

**Steps**, each with the parameters and optimizer state donated (as in a
training loop), each device one sequence of 1,024 tokens (``--batch-per-device``):

- ``reference`` (method ``reference``, layout ``jit``): a MaxText-style step for
  the same model and precision, no compjax: plain ``jax.jit`` of
  ``value_and_grad`` + ``optax.adamw`` (dense), the parameters and AdamW
  moments laid out by ``NamedSharding`` FSDP over the fast axis
  (``parallel.fsdp_specs``) and replicated over the slow axis, the batch
  sharded over both axes; on a ``data x fsdp x tensor`` mesh the parameters and
  moments laid out by :func:`tensor_specs` (over ``fsdp`` and ``tensor``) and
  the batch over ``data`` and ``fsdp`` (replicated over ``tensor``: tensor
  parallelism); XLA's sharding propagation inserts the gathers and
  all-reduces the gradients over the slow axis (:func:`reference_step`);
- :func:`compjax.parallel.data_parallel_step` in two layouts:
  ``replicated`` (the 2-D layout, ``specs=None``, ``fast_axis="fast"``: every
  device holds the whole parameters, optimizer and compressor state) and
  ``sharded`` (FSDP over the fast axis, ``specs=parallel.fsdp_specs(params, mesh)``:
  parameters and state ``P("data", *spec)``, every large leaf split along its
  largest dimension; on a ``data x fsdp x tensor`` mesh ``specs=tensor_specs(params, mesh)``:
  a block's ``(layers, d, 4d)`` MLP kernel ``P("data", None, "fsdp", "tensor")``,
  the batch over all three axes, the optimizer state laid out as the optimizer
  sees the parameters, :func:`optimizer_view`).  The replicated layout runs on
  ``slow x fast`` meshes only.

**Methods** (:data:`METHODS`): ``dense`` (``cj.identity`` then AdamW),
``topk`` (``cj.topk(0.01)`` then AdamW), ``sparseloco`` (``cj.sparseloco``:
DiLoCo with an AdamW inner optimizer, ``sync_every=100``, chunk top-k outer
gradients, 128 of each 64 x 64 tile with 2-bit statistical values, decayed
error feedback), ``powersgd`` (rank 4, then AdamW), ``dgc`` (``cj.dgc(0.001)``
then AdamW), ``streaming_diloco`` (``cj.diloco`` with an AdamW inner
optimizer, ``sync_every=100``, 4 fragments, overlap 1, 4-bit ``cj.e3m0``
outer gradients).

**Configurations** (:data:`PLAN`, filtered by ``--sizes``, ``--meshes``,
``--methods``): 125M, 1B and 8B on ``2 x 4`` (every method, both layouts); 8B
on ``2 x 8`` (every method, sharded); 70B on ``2 x 32`` (dense, SparseLoCo
and Streaming DiLoCo, sharded); on ``data x fsdp x tensor`` meshes (sharded by
:func:`tensor_specs`) 8B on ``2 x 2 x 2`` and ``2 x 4 x 2`` (every method) and
70B on ``2 x 16 x 2`` (dense, SparseLoCo and Streaming DiLoCo); the reference
beside each size and mesh.

**Numbers** per configuration (bytes of one device): ``argument`` (parameters,
optimizer state and the batch), ``output``, ``alias`` (outputs written into
donated arguments), ``temp`` (XLA's temporaries: activations kept for the
backward pass, gathered parameters, gradients, compressor temporaries),
``code`` (0 on XLA:CPU, whose thunk runtime reports none), and ``peak =
argument + output - alias + temp``: what the compiled program allocates (its
arguments, the outputs not written in place, and one temporary buffer that
XLA's liveness-based buffer assignment sizes); ``peak_vs_reference`` (peak over
the reference's on the same size, mesh and precision) and ``temp_vs_argument``.
A configuration *fits* an 80 GB accelerator when ``peak <= 80e9`` bytes (74.5
GiB, a margin below an 80 GB H100's usable memory for the runtime and the
framework).  Temporaries are XLA:CPU's: a GPU or TPU compiler fuses and
schedules differently (and may rematerialize), so they are an estimate; the
argument bytes are exact for any backend.  :func:`targets` checks the
configurations against the targets the sharded layout is built for.

Writes ``memory.json``, ``memory.md`` and ``memory_peak.md`` to ``runs/benchmarks``
(git-ignored), with ``--publish`` to ``experiments/results/benchmarks``, or to
``--out-dir``; the JSON holds every number, the command, provenance, the
compile time of each configuration, the load average and the run's wall and
CPU time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

#: Simulated CPU devices the default run needs: 70B on the 2 x 32 and 2 x 16 x 2 meshes.
MAX_DEVICES = 64

from experiments.cpu_devices import force_cpu_devices

if __name__ == "__main__":  # simulated CPU devices for the largest mesh of the plan
    force_cpu_devices(MAX_DEVICES)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from compjax.compressors.chains import works_on_any_cut
from compjax.parallel.placement import shard_view
from experiments import config_cli, records
from experiments.lm import model as lm_model
from experiments.lm import sharded as lm_sharded

PROG = "python -m experiments.benchmarks.memory"
SLOW, FAST = 2, 4  # the mesh of sizes outside PLAN (the tests' "tiny") and of the 1B argument target
AXIS, FAST_AXIS = "data", "fast"
#: The fast axes of a ``data x fsdp x tensor`` mesh (:func:`make_mesh` with three sizes).
FSDP_AXIS, TENSOR_AXIS = "fsdp", "tensor"
#: Logical axis -> mesh axis on a ``data x fsdp x tensor`` mesh: the repository's MaxText-style LM's rules
#: (:data:`experiments.lm.sharded.RULES`: ``embed -> fsdp``; ``vocab``, ``heads``, ``mlp -> tensor``), and the
#: stacked layer dimension unsharded.
RULES = (*lm_sharded.RULES, ("layers", None))
VOCAB = 32_000
#: Bytes an accelerator offers: 80 GB.
DEVICE_BYTES = 80 * 10**9
GIB = 2**30

#: Model sizes: :class:`experiments.lm.model.CharTransformer` keyword arguments (vocabulary :data:`VOCAB`).
#: ``groups`` splits the stacked blocks (8B: every leaf under 2**31 elements, for top-k's and DGC's indices).
SIZES: dict[str, dict] = {
    "125M": {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024, "groups": 1},
    "1B": {"d_model": 2048, "n_layers": 18, "n_heads": 16, "seq_len": 1024, "groups": 1},
    "8B": {"d_model": 4096, "n_layers": 38, "n_heads": 32, "seq_len": 1024, "groups": 2},
    # The 70B class: 64,965,722,112 parameters (80 layers of d 8192, as Llama-2-70B's depth and width); four
    # groups of 20 blocks, so that Streaming DiLoCo's 4 fragments each take one (with one group, one fragment
    # held all 80 blocks and synchronized 98% of the model at once); its MLP kernels still stack to 5.4e9
    # entries: for the methods without flat int32 indices.
    "70B": {"d_model": 8192, "n_layers": 80, "n_heads": 64, "seq_len": 1024, "groups": 4},
    # For tests: about a second per compile on CPU.
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "groups": 1},
}
TINY_VOCAB = 512
#: ``fp32``: parameters, compute and state in float32.  ``mixed``: float32 master parameters, AdamW moments
#: and compressor state; the loss casts each parameter to bfloat16 where it is used (bfloat16 compute and gradients,
#: :func:`compjax.parallel.compute_cast`).
PRECISIONS = ("mixed", "fp32")
COMPUTE_DTYPE = {"fp32": jnp.float32, "mixed": jnp.bfloat16}


def _adamw():
    return optax.adamw(3e-4, weight_decay=0.1)


#: method -> ``make(axis_name) -> optax transform`` (compressor over the slow axis, then AdamW).
METHODS: dict[str, Callable[[str], optax.GradientTransformation]] = {
    "dense": lambda ax: optax.chain(cj.identity(axis_name=ax), _adamw()),
    "topk": lambda ax: optax.chain(cj.topk(0.01, axis_name=ax), _adamw()),
    "sparseloco": lambda ax: cj.sparseloco(_adamw(), sync_every=100, k=128, chunk=64, value_bits=2, axis_name=ax),
    "powersgd": lambda ax: optax.chain(cj.powersgd(4, axis_name=ax), _adamw()),
    "dgc": lambda ax: optax.chain(cj.dgc(0.001, momentum=0.9, axis_name=ax), _adamw()),
    "streaming_diloco": lambda ax: cj.diloco(_adamw(), sync_every=100, fragments=4, overlap=1, alpha=0.5,
                                             compressor=cj.e3m0(axis_name=ax, skip_nonfinite=False), axis_name=ax),
}
LAYOUTS = ("replicated", "sharded")
#: Methods that index a flattened layer with int32 (``cj.topk``, ``cj.dgc``): refused for a leaf of 2**31
#: elements or more.  SparseLoCo's chunk top-k indexes within 64 x 64 tiles.
FLAT_INDEX_METHODS = ("topk", "dgc")
#: The method and layout names of the MaxText-style reference step's rows (:func:`reference_step`).
REFERENCE, REFERENCE_LAYOUT = "reference", "jit"
#: The default run: size -> ``[(mesh, methods (None: all of METHODS), layouts), ...]``, a mesh ``(slow, fast)``
#: or ``(data, fsdp, tensor)`` (:func:`make_mesh`); a size not named here runs every method in both layouts on
#: ``SLOW x FAST``.  Each size and mesh also gets the reference step's row.
PLAN: dict[str, list[tuple[tuple[int, ...], tuple[str, ...] | None, tuple[str, ...]]]] = {
    "125M": [((2, 4), None, LAYOUTS)],
    "1B": [((2, 4), None, LAYOUTS)],
    "8B": [((2, 4), None, LAYOUTS), ((2, 8), None, ("sharded",)), ((2, 2, 2), None, ("sharded",)),
           ((2, 4, 2), None, ("sharded",))],
    "70B": [((2, 32), ("dense", "sparseloco", "streaming_diloco"), ("sharded",)),
            ((2, 16, 2), ("dense", "sparseloco", "streaming_diloco"), ("sharded",))],
}
#: XLA:CPU compiled for speed of compilation: LLVM at its lowest effort and the older (non-MLIR) fusion
#: emitters.  The HLO passes and buffer assignment ``memory_analysis`` reads are unchanged: arguments, outputs
#: and aliases equal to the byte and temporaries within 8 KB of 2.7 GB of the default options' (125M, dgc
#: sharded and topk replicated, checked once), with compiles 4x faster.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                    "xla_cpu_use_fusion_emitters": False}


def init_shapes(vocab: int, *, d_model: int, n_layers: int, n_heads: int, seq_len: int, groups: int = 1,
                dtype=jnp.float32) -> dict:
    """The parameter tree of :func:`forward` as ``jax.ShapeDtypeStruct`` s (nothing allocated).

    The leaves and counts of :class:`experiments.lm.model.CharTransformer`, with
    the blocks in ``groups`` groups of ``L = n_layers / groups`` consecutive
    blocks, each group's parameters stacked (leading axis ``L``, as
    ``jax.lax.scan`` over layers wants them), ``g`` in ``0 .. groups - 1``::

        tok_embed/embedding (vocab, d)           pos_embed/embedding (seq_len, d)
        blocks/<g>/ln1/{scale,bias} (L, d)       blocks/<g>/attn/qkv/{kernel (L, d, 3d), bias (L, 3d)}
        blocks/<g>/attn/proj/{kernel (L, d, d), bias (L, d)}
        blocks/<g>/ln2/{scale,bias} (L, d)       blocks/<g>/mlp/fc/{kernel (L, d, 4d), bias (L, 4d)}
        blocks/<g>/mlp/proj/{kernel (L, 4d, d), bias (L, d)}
        ln_f/{scale,bias} (d,)                   head/kernel (d, vocab)

    Stacking keeps the compiled step's size (and its compile time) independent
    of the depth; groups keep every leaf under 2**31 elements where a method
    needs it (top-k's and DGC's int32 indices into a flattened layer: see
    :data:`FLAT_INDEX_METHODS`) and split the blocks into Streaming DiLoCo's
    fragments (one group per fragment: :func:`compjax.algorithms.fragment_assignment`
    strides numbered layers, here the groups, over the fragments).  Groups cost
    compile time (the 8B model in 19 groups took 16x longer to compile than in
    2), so the 70B class is 4 groups (one per fragment) and runs only the
    methods without flat indices.

    Raises:
      ValueError: ``groups`` does not divide ``n_layers``.
    """
    del n_heads
    if n_layers % groups:
        raise ValueError(f"groups={groups} must divide n_layers={n_layers}")
    d, L = d_model, n_layers // groups
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    ln = lambda *lead: {"scale": s(*lead, d), "bias": s(*lead, d)}
    dense = lambda din, dout: {"kernel": s(L, din, dout), "bias": s(L, dout)}
    return {
        "tok_embed": {"embedding": s(vocab, d)},
        "pos_embed": {"embedding": s(seq_len, d)},
        "blocks": [{"ln1": ln(L), "attn": {"qkv": dense(d, 3 * d), "proj": dense(d, d)}, "ln2": ln(L),
                    "mlp": {"fc": dense(d, 4 * d), "proj": dense(4 * d, d)}} for _ in range(groups)],
        "ln_f": ln(),
        "head": {"kernel": s(d, vocab)},
    }


def logical_axes(groups: int = 1) -> dict:
    """The logical axis names of every parameter of :func:`init_shapes` (same tree), one ``PartitionSpec`` each.

    Named as the repository's MaxText-style LM (:mod:`experiments.lm.sharded`)
    and Flax's LM examples name them: ``vocab`` (token rows of the embedding,
    columns of the head), ``embed`` (the residual width ``d``), ``heads`` (the
    attention's ``3d`` query/key/value outputs and the ``d`` inputs of its
    output projection: heads times their width), ``mlp`` (the ``4d`` hidden
    width), ``seq`` (positions) and ``layers`` (the stacked block dimension)::

        tok_embed/embedding ('vocab', 'embed')      head/kernel ('embed', 'vocab')
        attn/qkv/kernel ('layers', 'embed', 'heads')  attn/proj/kernel ('layers', 'heads', 'embed')
        mlp/fc/kernel ('layers', 'embed', 'mlp')      mlp/proj/kernel ('layers', 'mlp', 'embed')
        biases ('layers', <output>), LayerNorms ('layers', 'embed'), ln_f ('embed',), pos_embed ('seq', 'embed')

    Args:
      groups: the number of stacked block groups (``SIZES[size]['groups']``).

    Returns:
      A dict with :func:`init_shapes`' structure, a ``PartitionSpec`` of logical names per leaf.
    """
    ln = lambda *lead: {"scale": P(*lead, "embed"), "bias": P(*lead, "embed")}
    dense = lambda din, dout: {"kernel": P("layers", din, dout), "bias": P("layers", dout)}
    return {
        "tok_embed": {"embedding": P("vocab", "embed")},
        "pos_embed": {"embedding": P("seq", "embed")},
        "blocks": [{"ln1": ln("layers"), "attn": {"qkv": dense("embed", "heads"), "proj": dense("heads", "embed")},
                    "ln2": ln("layers"), "mlp": {"fc": dense("embed", "mlp"), "proj": dense("mlp", "embed")}}
                   for _ in range(groups)],
        "ln_f": ln(),
        "head": {"kernel": P("embed", "vocab")},
    }


def tensor_specs(params: dict, mesh, rules: tuple = RULES) -> dict:
    """The parameters' ``PartitionSpec`` on a ``data x fsdp x tensor`` mesh: :func:`logical_axes` mapped by ``rules``.

    The mapping is Flax's (``flax.linen.logical_to_mesh``, as MaxText maps its
    logical axes): with :data:`RULES` a block's ``(layers, d, 4d)`` MLP
    kernel is ``P(None, 'fsdp', 'tensor')``, the embedding ``(vocab, d)``
    ``P('tensor', 'fsdp')``, the head ``(d, vocab)`` ``P('fsdp', 'tensor')``,
    a LayerNorm's ``(layers, d)`` ``P(None, 'fsdp')``.  Mesh axes the mesh
    lacks or of size 1 are dropped (no worker axis: the specs are one
    worker's, as ``data_parallel_step(specs=)`` takes them).

    Args:
      params: :func:`init_shapes`' tree (arrays or ``jax.ShapeDtypeStruct``).
      mesh: a ``Mesh`` or ``AbstractMesh`` with the axes ``rules`` name.
      rules: ``(logical name, mesh axis or None)`` pairs, in order of precedence.

    Returns:
      A tree like ``params`` of ``PartitionSpec`` over the mesh's axes.

    Raises:
      ValueError: ``params`` is not :func:`init_shapes`' tree, or a mesh axis does not divide the dimension the
        rules shard over it (naming the leaf, the dimension and the axis).
    """
    names = logical_axes(len(params.get("blocks", ())) or 1)
    if jax.tree.structure(names, is_leaf=_is_spec) != jax.tree.structure(params):
        raise ValueError("params must be init_shapes()'s tree, got another structure: "
                         f"{jax.tree.structure(params)}")
    specs = nn.logical_to_mesh(names, rules)
    keep = {a for a in mesh.axis_names if mesh.shape[a] > 1}

    def trim(path, x, spec):
        out = []
        for dim, (n, entry) in enumerate(zip(x.shape, tuple(spec))):
            axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in keep)
            size = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
            if n % size:
                raise ValueError(f"params{jax.tree_util.keystr(path)}: dimension {dim} of size {n} is sharded over "
                                 f"{axes} of size {size}, which does not divide it")
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*out)

    return jax.tree_util.tree_map_with_path(trim, params, specs)


def optimizer_view(params: dict, specs: dict, mesh, tx: optax.GradientTransformation | None = None) -> dict:
    """How ``data_parallel_step(specs=)`` 's optimizer ``tx`` sees parameters laid out by :func:`tensor_specs`.

    :func:`compjax.parallel.placement.shard_view`: with a ``tx`` whose
    compressors work on shards cut any way
    (:func:`compjax.compressors.chains.works_on_any_cut`: dense, Streaming
    DiLoCo's E3M0), every leaf sharded over both ``fsdp`` and ``tensor`` as
    :func:`tensor_specs` lays it out (a block's ``(layers, d, 4d)`` MLP kernel
    ``P(None, 'fsdp', 'tensor')``); the other leaves, and every sharded leaf
    for the other methods (``tx`` None: all), cut along one dimension over
    ``fsdp`` and ``tensor`` together (that kernel ``P(None, ('fsdp',
    'tensor'), None)``).  The benchmark lays compjax's optimizer state out by
    these specs (``parallel.state_specs(tx, params, optimizer_view(...),
    mesh)``): the step keeps a state that arrives so, and re-lays out only the
    parameters and gradients the optimizer sees cut otherwise than the specs,
    not the whole state in and out of every step (8B dense on ``2 x 2 x 2``
    with the one-dimensional view: 21.0 GiB of temporaries with the state
    laid out as the parameters, 6.5 GiB so).

    Returns:
      A tree like ``params`` of ``PartitionSpec``.
    """
    leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    fast = tuple(a for a in (FSDP_AXIS, TENSOR_AXIS) if a in mesh.axis_names)
    _, view = shard_view(params, leaves, fast, mesh, own=tx is not None and works_on_any_cut(tx))
    return jax.tree.unflatten(jax.tree.structure(params), view)


def make_mesh(shape: tuple[int, ...]):
    """The mesh of a configuration: ``(slow, fast)`` -> :func:`compjax.parallel.make_2d_mesh` (axes ``data``,
    ``fast``); ``(data, fsdp, tensor)`` -> a mesh of :data:`AXIS`, :data:`FSDP_AXIS`, :data:`TENSOR_AXIS`,
    axes of type ``Auto`` (the sharded step leaves the fast axes to XLA's sharding propagation) on the first
    ``data * fsdp * tensor`` devices.

    Raises:
      ValueError: ``shape`` has neither two nor three sizes.
    """
    shape = tuple(int(n) for n in shape)
    if len(shape) == 2:
        return parallel.make_2d_mesh(*shape)
    if len(shape) != 3:
        raise ValueError(f"a mesh shape is (slow, fast) or (data, fsdp, tensor), got {shape!r}")
    return jax.make_mesh(shape, (AXIS, FSDP_AXIS, TENSOR_AXIS), axis_types=(AxisType.Auto,) * 3,
                         devices=jax.devices()[: math.prod(shape)])


def _mesh_name(mesh) -> str:
    return "x".join(str(n) for n in mesh.shape.values())


def _layer_norm(x, p, eps=1e-6):  # flax.nnx.LayerNorm's default epsilon
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def forward(params: dict, ids, *, n_heads: int, remat: bool = True, compute_dtype=None):
    """Logits ``(B, T, vocab)`` of ``ids`` ``(B, T)``: :class:`experiments.lm.model.CharTransformer`'s computation.

    Token + learned position embeddings, pre-LayerNorm blocks (causal
    multi-head attention, then a 4x GELU MLP, each added to the residual), a
    final LayerNorm and an untied head; the blocks run under ``jax.lax.scan``
    over each group of stacked block parameters, each block rematerialized in the
    backward pass with ``remat`` (only its input is kept: activation
    checkpointing, as large models are trained).  With ``compute_dtype`` (e.g.
    ``jnp.bfloat16``: mixed precision), each parameter is cast to it where it is
    used (one layer's inside the scan, the embedding rows looked up, the head)
    with :func:`compjax.parallel.compute_cast`, so activations, matmuls and the
    parameters' gradients are in that dtype; the logits are in it too.
    """
    b, t = ids.shape
    cast = (lambda tree: tree) if compute_dtype is None else (lambda tree: parallel.compute_cast(tree, compute_dtype))
    x = cast(params["tok_embed"]["embedding"][ids]) + cast(params["pos_embed"]["embedding"][:t])
    causal = jnp.tril(jnp.ones((t, t), bool))

    def block(x, p):
        p = cast(p)  # this layer's compute copy
        d = x.shape[-1]
        h = n_heads
        y = _layer_norm(x, p["ln1"])
        qkv = y @ p["attn"]["qkv"]["kernel"] + p["attn"]["qkv"]["bias"]
        q, k, v = (z.reshape(b, t, h, d // h) for z in jnp.split(qkv, 3, axis=-1))
        scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // h)
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        att = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
        x = x + att @ p["attn"]["proj"]["kernel"] + p["attn"]["proj"]["bias"]
        y = _layer_norm(x, p["ln2"])
        y = jax.nn.gelu(y @ p["mlp"]["fc"]["kernel"] + p["mlp"]["fc"]["bias"])
        return x + y @ p["mlp"]["proj"]["kernel"] + p["mlp"]["proj"]["bias"], None

    for group in params["blocks"]:
        x, _ = jax.lax.scan(jax.checkpoint(block) if remat else block, x, group)
    return _layer_norm(x, cast(params["ln_f"])) @ cast(params["head"]["kernel"])


def abstract_model(size: str, precision: str = "mixed", vocab: int | None = None, remat: bool = True):
    """``(params, loss_fn)``: abstract float32 parameters (nothing allocated) and the LM loss.

    Args:
      size: a key of :data:`SIZES`.
      precision: one of :data:`PRECISIONS`: the loss computes in float32 (``"fp32"``) or casts the
        float32 parameters to bfloat16 where they are used (``"mixed"``: their gradients come out bfloat16);
        the loss itself is float32.
      vocab: vocabulary size (default :data:`VOCAB`, :data:`TINY_VOCAB` for ``"tiny"``).
      remat: rematerialize each block in the backward pass.

    Returns:
      params: :func:`init_shapes`' tree of float32 ``jax.ShapeDtypeStruct``.
      loss_fn: ``(params, windows (B, T + 1) int32) -> scalar`` mean next-token cross-entropy (nats).

    Raises:
      ValueError: ``size`` or ``precision`` unknown.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    vocab = vocab or (TINY_VOCAB if size == "tiny" else VOCAB)
    cfg = SIZES[size]
    params = init_shapes(vocab, **cfg, dtype=jnp.float32)
    count = sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(params))
    expected = lm_model.num_params(vocab, **{k: v for k, v in cfg.items() if k != "groups"})
    if count != expected:  # the testbed's model, leaf for leaf
        raise AssertionError(f"{size}: {count:,} parameters, the testbed's CharTransformer has {expected:,}")
    compute = None if precision == "fp32" else COMPUTE_DTYPE[precision]

    def loss_fn(p, windows):
        logits = forward(p, windows[:, :-1], n_heads=cfg["n_heads"], remat=remat,
                         compute_dtype=compute).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    return params, loss_fn


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _structs(tree, specs, mesh, n=None):
    """``ShapeDtypeStruct`` s with ``NamedSharding(mesh, spec)``: worker-stacked ``(n, *shape)`` unless ``n`` is None."""
    lead = () if n is None else (n,)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype, sharding=NamedSharding(mesh, s)),
                        tree, specs, is_leaf=_is_spec)


def _tree_bytes(tree) -> int:
    return int(sum(int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def _whole_bytes(trees_and_specs) -> int:
    """Bytes of the leaves whose spec shards nothing (held whole by every fast device)."""
    return sum(_tree_bytes([x for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=_is_spec))
                            if all(e is None for e in tuple(s))]) for tree, specs in trees_and_specs)


def reference_step(loss_fn, tx: optax.GradientTransformation, mesh, param_specs, state_specs, batch_spec):
    """A MaxText-style train step: ``jax.jit`` with ``NamedSharding`` s, no compjax, no worker axis.

    ``step(params, opt_state, batch) -> (params, opt_state, loss)``: the
    gradient of ``loss_fn`` over the whole (sharded) batch, then ``tx``.  The
    parameters and optimizer state live at ``NamedSharding(mesh, spec)`` (FSDP
    specs over the fast axis: replicated over the slow one), the batch at
    ``batch_spec``; XLA's sharding propagation inserts the parameter gathers
    and the gradient reductions (a reduce-scatter over the fast axis, an
    all-reduce over the slow one).  Parameters and state are donated.

    Args:
      loss_fn: ``(params, batch) -> scalar``.
      tx: the optimizer (dense AdamW here).
      mesh: the ``slow x fast`` mesh.
      param_specs, state_specs: trees of ``PartitionSpec`` like the parameters and ``tx.init(params)``.
      batch_spec: the batch's ``PartitionSpec`` (e.g. ``P(("data", "fast"))``).

    Returns:
      The jitted step (``.lower(...)`` takes ``ShapeDtypeStruct`` s).
    """
    shard = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)
    p_sh, s_sh = shard(param_specs), shard(state_specs)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, in_shardings=(p_sh, s_sh, NamedSharding(mesh, batch_spec)),
                   out_shardings=(p_sh, s_sh, NamedSharding(mesh, P())), donate_argnums=(0, 1))


class Built(NamedTuple):
    """One configuration's training step and its abstract inputs (:func:`build`)."""

    step: Any  #: the step (``parallel.data_parallel_step``'s, or :func:`reference_step`'s): has ``.lower``
    inputs: tuple  #: ``(params, opt_state, batch)`` as ``jax.ShapeDtypeStruct`` s with their ``NamedSharding``
    row: dict  #: the configuration's name and logical sizes, the first columns of :func:`measure`'s row


def compiler_options() -> dict | None:
    """:data:`COMPILER_OPTIONS` on the CPU backend; None (the compiler's defaults) on a GPU or TPU, whose
    memory is then that of the program a training run compiles."""
    return COMPILER_OPTIONS if jax.default_backend() == "cpu" else None


def measure(size: str, method: str, layout: str, mesh, *, precision: str = "mixed", batch_per_device: int = 1,
            vocab: int | None = None) -> dict:
    """Compile one configuration's training step from abstract inputs and read its memory analysis.

    Args:
      size: a key of :data:`SIZES`.
      method: a key of :data:`METHODS`, or :data:`REFERENCE` (with ``layout`` :data:`REFERENCE_LAYOUT`:
        :func:`reference_step` with dense AdamW).
      layout: ``"replicated"`` (``specs=None``), ``"sharded"`` (``parallel.fsdp_specs``), or
        :data:`REFERENCE_LAYOUT` for the reference.
      mesh: a ``slow x fast`` mesh (:func:`compjax.parallel.make_2d_mesh`), axes ``"data"`` and ``"fast"``, or
        a ``data x fsdp x tensor`` one (:func:`make_mesh`; layouts ``"sharded"`` and the reference's only).
      precision: one of :data:`PRECISIONS` (see :func:`abstract_model`).
      batch_per_device: sequences of ``seq_len + 1`` tokens per device.
      vocab: vocabulary size (see :func:`abstract_model`).

    Returns:
      A dict: ``size``, ``mesh`` (``"2x4"``), ``method``, ``layout``, ``precision``,
      ``params`` (count), the per-device bytes of the compiled step
      (``argument``, ``output``, ``alias``, ``temp``, ``code``, ``peak``), the
      logical bytes (one worker, whole) of the parameters (``param_bytes``) and
      optimizer state (``state_bytes``), ``whole_state_bytes`` (per device: the
      leaves held whole by every fast device in a sharded layout, the batch
      included; 0 in the replicated one), ``fits``, ``lower_s`` and ``compile_s``.

    Raises:
      ValueError: an unknown ``layout`` or ``method``, the reference's method with another layout, the
        replicated layout on a ``data x fsdp x tensor`` mesh, or a method of :data:`FLAT_INDEX_METHODS` on a
        model with a leaf of 2**31 elements or more.
    """
    built = build(size, method, layout, mesh, precision=precision, batch_per_device=batch_per_device, vocab=vocab)
    t0 = time.perf_counter()
    lowered = built.step.lower(*built.inputs)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options())
    lower_s, compile_s = t1 - t0, time.perf_counter() - t1
    return memory_row(built, compiled, lower_s=lower_s, compile_s=compile_s)


def memory_row(built: Built, compiled, *, lower_s: float = 0.0, compile_s: float = 0.0) -> dict:
    """:func:`measure`'s row of a configuration from its compiled step (``compiled.memory_analysis()``)."""
    ma = compiled.memory_analysis()
    row = {
        **built.row,
        "argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes), "temp": int(ma.temp_size_in_bytes),
        "code": int(ma.generated_code_size_in_bytes), "lower_s": lower_s, "compile_s": compile_s,
    }
    row["peak"] = row["argument"] + row["output"] - row["alias"] + row["temp"]
    row["fits"] = row["peak"] <= DEVICE_BYTES
    return row


def build(size: str, method: str, layout: str, mesh, *, precision: str = "mixed", batch_per_device: int = 1,
          vocab: int | None = None) -> Built:
    """One configuration's training step and abstract inputs (nothing allocated, nothing compiled).

    Args and Raises: as :func:`measure`.

    Returns:
      :class:`Built`: the step, its inputs and the row's first columns (``size``, ``mesh``, ``method``,
      ``layout``, ``precision``, ``params``, ``param_bytes``, ``state_bytes``, ``whole_state_bytes``).
    """
    if (method == REFERENCE) != (layout == REFERENCE_LAYOUT):
        raise ValueError(f"method {REFERENCE!r} goes with layout {REFERENCE_LAYOUT!r} and only with it, got "
                         f"method={method!r}, layout={layout!r}")
    if layout not in (*LAYOUTS, REFERENCE_LAYOUT):
        raise ValueError(f"layout must be one of {(*LAYOUTS, REFERENCE_LAYOUT)}, got {layout!r}")
    if method != REFERENCE and method not in METHODS:
        raise ValueError(f"method must be {REFERENCE!r} or one of {list(METHODS)}, got {method!r}")
    params, loss_fn = abstract_model(size, precision, vocab)
    largest = max(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(params))
    if method in FLAT_INDEX_METHODS and largest >= 2**31:
        raise ValueError(f"method {method!r} indexes a flattened layer with int32 and {size}'s largest leaf has "
                         f"{largest:,} elements (2**31 or more): split the blocks into more SIZES[{size!r}]['groups']")
    tx = _adamw() if method == REFERENCE else METHODS[method](AXIS)
    state = jax.eval_shape(tx.init, params)
    tensor = FSDP_AXIS in mesh.axis_names  # a data x fsdp x tensor mesh
    if tensor and layout == "replicated":
        raise ValueError(f"layout 'replicated' runs on a slow x fast mesh only, got a mesh of axes {mesh.axis_names}:"
                         " take layout 'sharded'")
    fast_axes = (FSDP_AXIS, TENSOR_AXIS) if tensor else (FAST_AXIS,)
    slow, fast = mesh.shape[AXIS], math.prod(mesh.shape[a] for a in fast_axes)
    seq = SIZES[size]["seq_len"]
    rows = slow * fast * batch_per_device
    batch_spec = P((AXIS, *fast_axes))
    if layout == REFERENCE_LAYOUT and tensor:  # tensor parallelism: each tensor group shares its rows
        batch_spec = P((AXIS, FSDP_AXIS))
    batch = jax.ShapeDtypeStruct((rows, seq + 1), jnp.int32, sharding=NamedSharding(mesh, batch_spec))
    batch_bytes = _tree_bytes(batch) // math.prod(mesh.shape[a] for a in batch_spec[0])  # one device's rows
    if layout in (REFERENCE_LAYOUT, "sharded"):
        specs = tensor_specs(params, mesh) if tensor else parallel.fsdp_specs(params, mesh, fast_axis=FAST_AXIS)
        sspecs = parallel.state_specs(tx, params, specs, mesh)
        if tensor and layout == "sharded":  # compjax's state laid out as its optimizer sees it: no re-layout
            sspecs = parallel.state_specs(tx, params, optimizer_view(params, specs, mesh, tx), mesh)
        whole_bytes = _whole_bytes([(state, sspecs), (params, specs)]) + batch_bytes
    if layout == REFERENCE_LAYOUT:
        p_in, s_in = _structs(params, specs, mesh), _structs(state, sspecs, mesh)
        step = reference_step(loss_fn, tx, mesh, specs, sspecs, batch_spec)
    elif layout == "sharded":
        stacked = lambda tree: jax.tree.map(lambda s: P(AXIS, *tuple(s)), tree, is_leaf=_is_spec)
        p_in, s_in = _structs(params, stacked(specs), mesh, slow), _structs(state, stacked(sspecs), mesh, slow)
        step = parallel.data_parallel_step(loss_fn, tx, mesh, axis_name=AXIS, fast_axis=None if tensor else FAST_AXIS,
                                           specs=specs, donate=True)
    else:
        spec = P((AXIS, FAST_AXIS))
        p_in = _structs(params, jax.tree.map(lambda _: spec, params), mesh, slow * fast)
        s_in = _structs(state, jax.tree.map(lambda _: spec, state), mesh, slow * fast)
        whole_bytes = 0
        step = parallel.data_parallel_step(loss_fn, tx, mesh, axis_name=AXIS, fast_axis=FAST_AXIS, donate=True)
    row = {
        "size": size, "mesh": _mesh_name(mesh), "method": method, "layout": layout, "precision": precision,
        "params": int(sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(params))),
        "param_bytes": _tree_bytes(params), "state_bytes": _tree_bytes(state), "whole_state_bytes": whole_bytes,
    }
    return Built(step, (p_in, s_in, batch), row)


def _describe(e: Exception) -> str:
    """``Type: first line of the message (at compjax/file.py:line, the innermost compjax frame)``."""
    where = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}compjax{os.sep}" in f.filename]
    at = f" (at {where[-1].filename.rsplit(os.sep + 'compjax' + os.sep, 1)[1]}:{where[-1].lineno})" if where else ""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}{at}"


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x4"`` -> ``(2, 4)`` (slow x fast); ``"2x2x2"`` -> ``(2, 2, 2)`` (data x fsdp x tensor).

    Raises:
      ValueError: not two or three positive integers joined by ``x``.
    """
    parts = text.lower().split("x")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a mesh is written SLOWxFAST or DATAxFSDPxTENSOR with positive integers, e.g. 2x4 or "
                         f"2x2x2; got {text!r}")
    return tuple(int(p) for p in parts)


def plan(sizes, methods=None, meshes=None) -> list[tuple[str, tuple[int, ...], tuple[str, ...], tuple[str, ...]]]:
    """The configurations to run: ``[(size, mesh, methods, layouts), ...]`` from :data:`PLAN`.

    Args:
      sizes: keys of :data:`SIZES`; one outside :data:`PLAN` runs on ``SLOW x FAST``, every method, both layouts.
      methods: keep only these methods of each entry (None: all).
      meshes: keep only these meshes, ``(slow, fast)`` or ``(data, fsdp, tensor)`` (None: all of each size's).

    Returns:
      One tuple per size and mesh that has a method left, in :data:`PLAN`'s order of meshes.
    """
    out = []
    for size in sizes:
        for mesh, ms, lays in PLAN.get(size, [((SLOW, FAST), None, LAYOUTS)]):
            if meshes is not None and mesh not in meshes:
                continue
            ms = tuple(m for m in (ms or METHODS) if methods is None or m in methods)
            if ms:
                out.append((size, mesh, ms, lays))
    return out


def run(configs, *, precision: str = "mixed", batch_per_device: int = 1, reference: bool = True,
        log=None) -> list[dict]:
    """:func:`measure` for every configuration of :func:`plan`: per size and mesh the reference, then each
    method in each layout; rows in that order, with :func:`add_ratios`' columns.

    A configuration that fails to trace or compile gives a row with ``error``
    (the exception's type and first line) and no byte counts.
    """
    rows = []
    for size, shape, methods, layouts in configs:
        mesh = make_mesh(shape)
        todo = [(REFERENCE, REFERENCE_LAYOUT)] if reference else []
        todo += [(m, lay) for m in methods for lay in layouts]
        for method, lay in todo:
            try:
                row = measure(size, method, lay, mesh, precision=precision, batch_per_device=batch_per_device)
            except Exception as e:  # noqa: BLE001 - recorded in the row, not hidden: the configuration does not build
                row = {"size": size, "mesh": _mesh_name(mesh), "method": method, "layout": lay,
                       "precision": precision, "error": _describe(e)}
            rows.append(row)
            if log and "error" in row:
                log(f"{size} {row['mesh']} {method} {lay}: fails: {row['error']}")
            elif log:
                log(f"{size} {row['mesh']} {method} {lay}: argument {row['argument'] / GIB:.2f} GiB, temp "
                    f"{row['temp'] / GIB:.2f} GiB, peak {row['peak'] / GIB:.2f} GiB, compile {row['compile_s']:.1f} s")
    return add_ratios(rows)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set ``peak_vs_reference`` (peak / the reference row's of the same size, mesh and precision; None
    without one) and ``temp_vs_argument`` on every row that built; returns ``rows``."""
    refs = {(r["size"], r["mesh"], r["precision"]): r for r in rows if r["method"] == REFERENCE and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        ref = refs.get((r["size"], r["mesh"], r["precision"]))
        r["peak_vs_reference"] = r["peak"] / ref["peak"] if ref else None
        r["temp_vs_argument"] = r["temp"] / r["argument"]
    return rows


#: Targets of the sharded layout (the published configuration: mixed precision): the size and the meshes of
#: 8 devices they are checked on (FSDP over 4 devices, and the same 4 as fsdp x tensor).
FIT_SIZE, FIT_MESHES = "8B", ("2x4", "2x2x2")
BIG_SIZE, BIG_METHODS = "70B", ("sparseloco", "streaming_diloco")
REFERENCE_BOUND, TEMP_BOUND = 1.10, 0.25


def targets(rows: list[dict], size: str = "1B") -> list[dict]:
    """The targets the sharded layout is built for, checked on the rows present.

    - sharded ``size`` argument bytes per device <= replicated / fast + 5%, every method (on ``SLOW x FAST``);
    - at :data:`FIT_SIZE` on each of :data:`FIT_MESHES`, sharded: every method's peak fits (<= :data:`DEVICE_BYTES`),
      dense's peak <= :data:`REFERENCE_BOUND` x the reference's, every method's temporaries <=
      :data:`TEMP_BOUND` x its arguments;
    - at :data:`BIG_SIZE`, sharded, on whatever mesh was run: SparseLoCo and Streaming DiLoCo fit.

    Returns:
      ``[{"target", "method", "mesh", "measured", "bound", "met"}, ...]``; a configuration
      that failed to build has ``measured`` None and is not met.
    """
    out = []
    mesh0 = f"{SLOW}x{FAST}"
    by = {(r["size"], r["mesh"], r["method"], r["layout"]): r for r in rows}

    def add(name, r, measured, bound, mesh):
        ok = r is not None and "error" not in r and measured is not None
        out.append({"target": name, "method": r["method"], "mesh": mesh, "measured": measured if ok else None,
                    "bound": bound, "met": bool(ok and measured <= bound)})

    for (s, mesh, m, lay), r in by.items():
        rep = by.get((s, mesh, m, "replicated"))
        if s != size or mesh != mesh0 or lay != "sharded" or rep is None:
            continue
        ok = "error" not in r and "error" not in rep
        add(f"sharded {size} argument bytes <= replicated / {FAST} + 5%", r,
            r["argument"] / rep["argument"] if ok else None, 1.05 / FAST, mesh)
    for (s, mesh, m, lay), r in by.items():
        if s == FIT_SIZE and mesh in FIT_MESHES and lay == "sharded":
            add(f"{FIT_SIZE} sharded peak GiB <= {DEVICE_BYTES / GIB:.1f}", r, r.get("peak", 0) / GIB,
                DEVICE_BYTES / GIB, mesh)
    for (s, mesh, m, lay), r in by.items():
        if s == FIT_SIZE and mesh in FIT_MESHES and lay == "sharded" and m == "dense":
            ref = by.get((s, mesh, REFERENCE, REFERENCE_LAYOUT))
            ok = "error" not in r and ref is not None and "error" not in ref
            add(f"{FIT_SIZE} dense sharded peak / reference peak <= {REFERENCE_BOUND:.2f}", r,
                r["peak"] / ref["peak"] if ok else None, REFERENCE_BOUND, mesh)
    for (s, mesh, m, lay), r in by.items():
        if s == FIT_SIZE and mesh in FIT_MESHES and lay == "sharded":
            add(f"{FIT_SIZE} sharded temporaries / arguments <= {TEMP_BOUND:.2f}", r, r.get("temp_vs_argument"),
                TEMP_BOUND, mesh)
    for (s, mesh, m, lay), r in by.items():
        if s == BIG_SIZE and lay == "sharded" and m in BIG_METHODS:
            add(f"{BIG_SIZE} sharded peak GiB <= {DEVICE_BYTES / GIB:.1f}", r, r.get("peak", 0) / GIB,
                DEVICE_BYTES / GIB, mesh)
    return out


def _gib(x: int) -> str:
    return f"{x / GIB:,.2f}"


def _columns(rows) -> list[tuple[str, str]]:
    """The (size, mesh) pairs of ``rows``, in order."""
    return list(dict.fromkeys((r["size"], r["mesh"]) for r in rows))


def summary(rows: list[dict]) -> list[str]:
    """The short table: per-device peak GiB of each method, sharded (and the reference), per size and mesh,
    with the ratio to the reference's peak (✗: does not fit)."""
    cols = _columns(rows)
    by = {(r["size"], r["mesh"], r["method"], r["layout"]): r for r in rows}
    params = {r["size"]: r["params"] for r in rows if "params" in r}

    def cell(r):
        if r is None:
            return "—"
        if "error" in r:
            return "fails¹"
        ratio = r.get("peak_vs_reference")
        text = f"{r['peak'] / GIB:,.1f}" + ("" if r["fits"] else " ✗")
        return text + (f" ({ratio:.2f}×)" if ratio is not None and r["method"] != REFERENCE else "")

    head = [f"{s} ({params[s] / 1e9:.2f}B) {mesh}" if s in params else f"{s} {mesh}" for s, mesh in cols]
    lines = ["| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(cols)]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for m in sorted(methods, key=lambda m: m != REFERENCE):
        lay = REFERENCE_LAYOUT if m == REFERENCE else "sharded"
        name = "reference (jit + NamedSharding, AdamW)" if m == REFERENCE else m
        cells = [cell(by.get((s, mesh, m, lay))) for s, mesh in cols]
        if any(c != "—" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def verdict(result: dict) -> str:
    """One paragraph: which targets every configuration meets and which configurations miss which target."""
    tg = result.get("targets") or []
    if not tg:
        return "No target applies to the configurations run."
    names = list(dict.fromkeys(t["target"] for t in tg))
    parts = []
    for name in names:
        ts = [t for t in tg if t["target"] == name]
        missed = [t for t in ts if not t["met"]]
        if not missed:
            meshes = list(dict.fromkeys(t["mesh"] for t in ts))
            who = (", ".join(t["method"] for t in ts) if len(meshes) == 1 else "; ".join(
                f"{', '.join(t['method'] for t in ts if t['mesh'] == m)} on {m}" for m in meshes))
            parts.append(f"met by all {len(ts)} ({who})")
            continue
        fmt = lambda t: (f"{t['method']} on {t['mesh']} (does not build)" if t["measured"] is None else
                         f"{t['method']} on {t['mesh']} ({t['measured']:.2f})")
        parts.append(f"missed by {len(missed)} of {len(ts)}: " + ", ".join(fmt(t) for t in missed))
    body = "; ".join(f"*{n}*: {p}" for n, p in zip(names, parts))
    met = sum(t["met"] for t in tg)
    return f"Targets ({result.get('precision', '')} precision): {met} of {len(tg)} met. {body}."


def _flags_text(flags: str | None) -> str:
    """The XLA:CPU scheduler setting the run compiled with, for the table's header ('' when not recorded)."""
    if flags is None:
        return ""
    off = "--xla_cpu_enable_concurrency_optimized_scheduler=false" in flags
    return ("; XLA:CPU's concurrency-optimized scheduler off, `--xla_cpu_enable_concurrency_optimized_scheduler=false`,"
            " as the tests run" if off else "; XLA:CPU's default scheduler")


def markdown(result: dict) -> str:
    rows = result["rows"]
    load = result.get("loadavg", {})
    prec = result.get("precision", "fp32")
    prec_text = ("float32 master parameters, AdamW moments and compressor state, bfloat16 compute and gradients "
                 "(each parameter cast where the loss uses it, `compjax.parallel.compute_cast`)" if prec == "mixed" else "float32 parameters, state and compute")
    meshes = ", ".join(dict.fromkeys(r["mesh"].replace("x", " x ") for r in rows))
    lines = [
        f"Command: `{result['command']}`  ",
        (f"Meshes: {meshes} simulated CPU devices (jax {result['machine']['jax']}); precision `{prec}`: "
         f"{prec_text}; {result['batch_per_device']} sequence(s) of {{seq_len}} + 1 tokens per device; parameters "
         "and optimizer state donated.  "),
        (f"Fits: peak <= {DEVICE_BYTES / 1e9:g} GB ({DEVICE_BYTES / GIB:.1f} GiB) per device.  Per-device GiB "
         "from `compiled.memory_analysis()` (XLA:CPU's buffer assignment; temporaries on GPU/TPU differ"
         f"{_flags_text(result['machine'].get('xla_flags'))}).  "
         "Reference: a MaxText-style step for the same model (plain `jax.jit`, parameters and AdamW moments "
         "`NamedSharding`-sharded over the fast axis, batch over both axes, dense AdamW, no compjax"
         + ("; on a `data x fsdp x tensor` mesh the parameters (the reference's and compjax's) and the reference's "
            "AdamW moments laid out by logical-axis rules, `embed` over `fsdp`, `vocab`, `heads` and `mlp` over "
            "`tensor` (`tensor_specs`), compjax's optimizer state as its optimizer sees the parameters "
            "(`optimizer_view`: for dense and Streaming DiLoCo, whose compressors work on shards cut any way, every "
            "leaf sharded over both fast axes as `tensor_specs` lays it out; otherwise each sharded leaf cut along "
            "one dimension over `fsdp` and `tensor` together), the "
            "reference's batch over `data` and `fsdp`, compjax's over all three axes"
            if any(r["mesh"].count("x") == 2 for r in rows) else "") + ").  "),
        (f"Load average before {', '.join(f'{x:.2f}' for x in load.get('before', []))}, after "
         f"{', '.join(f'{x:.2f}' for x in load.get('after', []))}; run took {result.get('wall_s', 0):.0f} s "
         f"({result.get('cpu_s', 0):.0f} s of CPU time)."),
        "",
        verdict(result),
        "",
    ]
    if result.get("targets"):
        lines += ["| target | method | mesh | measured | bound | met |", "|---|---|---|---|---|---|"]
        for t in result["targets"]:
            measured = "fails" if t["measured"] is None else f"{t['measured']:.4f}"
            lines.append(f"| {t['target']} | {t['method']} | {t['mesh']} | {measured} | {t['bound']:.4f} | "
                         f"{'yes' if t['met'] else 'no'} |")
        lines.append("")
    lines += [f"Peak GiB per device, sharded, and its ratio to the reference's (✗: over {DEVICE_BYTES / 1e9:g} GB):",
              "", *summary(rows), ""]
    errors = list(dict.fromkeys(r["error"] for r in rows if "error" in r))
    if errors:
        lines += ["¹ the step does not build: " + "; ".join(f"`{e}`" for e in errors), ""]
    models = {r["size"]: r["params"] for r in rows if "params" in r}
    lines += ["Models: " + ", ".join(f"{s}: {n:,} parameters ({SIZES[s]['n_layers']} layers, d "
                                     f"{SIZES[s]['d_model']})" for s, n in models.items()), "",
              ("| model | mesh | method | layout | argument GiB | output GiB | aliased GiB | temp GiB | peak GiB "
               "| fits 74.5 GiB | peak / reference | temp / argument | lower s | compile s |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['mesh']} | {r['method']} | {r['layout']} | fails: {r['error']} |"
                         + " |" * 9)
            continue
        ratio = r.get("peak_vs_reference")
        lines.append(f"| {r['size']} | {r['mesh']} | {r['method']} | {r['layout']} | {_gib(r['argument'])} | "
                     f"{_gib(r['output'])} | {_gib(r['alias'])} | {_gib(r['temp'])} | {_gib(r['peak'])} | "
                     f"{'yes' if r['fits'] else 'no'} | {'—' if ratio is None else f'{ratio:.2f}'} | "
                     f"{r['temp_vs_argument']:.2f} | {r['lower_s']:.1f} | {r['compile_s']:.1f} |")
    seqs = dict.fromkeys(str(SIZES[s]["seq_len"]) for s in models)
    return "\n".join(lines).replace("{seq_len}", "/".join(seqs)) + "\n"


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = config_cli.OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(PLAN), help=f"comma-separated, of {list(SIZES)}")
    p.add_argument("--meshes", default=None,
                   help="comma-separated SLOWxFAST or DATAxFSDPxTENSOR meshes to keep of each size's "
                        "(default: all of PLAN's)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {list(METHODS)}")
    p.add_argument("--precision", default="mixed", choices=PRECISIONS,
                   help="mixed: float32 master parameters and state, bfloat16 compute and gradients; fp32: all float32")
    p.add_argument("--no-reference", action="store_true", help="skip the MaxText-style reference rows")
    p.add_argument("--batch-per-device", type=int, default=1, help="sequences per device")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite memory.md and memory_peak.md from the memory.json already in the output folder")
    records.add_output_arguments(p, "benchmarks")
    args = p.parse_args(argv)
    if args.report_only:
        out_dir = records.output_dir(args, "benchmarks")
        result = json.loads((out_dir / "memory.json").read_text())
        write_markdown(result, out_dir)
        return result
    sizes, methods = args.sizes.split(","), args.methods.split(",")
    for name, given, known in (("--sizes", sizes, SIZES), ("--methods", methods, METHODS)):
        bad = [x for x in given if x not in known]
        if bad:
            p.error(f"{name}: unknown {bad}, known {list(known)}")
    try:
        meshes = None if args.meshes is None else [parse_mesh(m) for m in args.meshes.split(",")]
    except ValueError as e:
        p.error(f"--meshes: {e}")
    configs = plan(sizes, methods, meshes)
    if not configs:
        p.error("no configuration left: --sizes, --meshes and --methods select nothing of PLAN")
    need = max(math.prod(shape) for _, shape, _, _ in configs)
    if jax.device_count() < need:
        p.error(f"needs {need} devices, found {jax.device_count()} "
                f"(XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX starts)")
    out_dir = records.output_dir(args, "benchmarks")
    command = " ".join([PROG, *argv])
    load_before, t0, c0 = os.getloadavg(), time.perf_counter(), time.process_time()
    rows = run(configs, precision=args.precision, batch_per_device=args.batch_per_device,
               reference=not args.no_reference, log=lambda s: print(s, file=sys.stderr, flush=True))
    result = {"command": command, "precision": args.precision, "batch_per_device": args.batch_per_device,
              "meshes": sorted({r["mesh"] for r in rows}), "device_bytes": DEVICE_BYTES, "vocab": VOCAB,
              "sizes": {s: SIZES[s] for s in sizes}, "methods": methods,
              "machine": {"jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                          "devices": jax.device_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")},
              "rows": rows, "targets": targets(rows)}
    result["provenance"] = records.provenance(command)
    result["loadavg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    result["wall_s"], result["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(write_markdown(result, out_dir), end="")
    return result


def peak_table(result: dict) -> str:
    """``memory_peak.md``: :func:`summary`'s table, a blank line and :func:`verdict`'s paragraph."""
    return "\n".join([*summary(result["rows"]), "", verdict(result)]) + "\n"


def write_markdown(result: dict, out_dir: Path) -> str:
    """Write ``memory.md`` (everything) and ``memory_peak.md`` (the sharded page's peak table, then
    :func:`verdict`'s paragraph) from ``result``."""
    md = markdown(result)
    (out_dir / "memory.md").write_text(md)
    (out_dir / "memory_peak.md").write_text(peak_table(result))
    print(f"wrote {out_dir}/memory.{{json,md}} and memory_peak.md", file=sys.stderr)
    return md


if __name__ == "__main__":
    main()
