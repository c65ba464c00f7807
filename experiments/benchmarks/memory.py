"""Per-device memory of the LM training step at 125M, 1B and 8B parameters, replicated vs sharded, without the memory.

    python -m experiments.benchmarks.memory [--sizes 125M,1B,8B] [--methods dense,topk,...] [--dtype float32]
    python -m experiments.benchmarks.memory --publish     # the committed results (experiments/results/benchmarks)

Every configuration is compiled ahead of time from abstract inputs
(``jax.ShapeDtypeStruct`` with a ``NamedSharding``: nothing is allocated) on a
``2 x 4`` mesh of simulated CPU devices (``parallel.make_2d_mesh(2, 4)``: 2
hosts of 4 devices), and XLA's buffer assignment of the compiled step is read
back (``compiled.memory_analysis()``, bytes of one device's program).

**Model**: the LM testbed's transformer (:class:`experiments.lm.model.CharTransformer`:
GPT-2 shaped, learned positions, pre-LayerNorm blocks, 4x GELU MLP, untied
head; float32 parameters, the master copy mixed-precision training keeps, or
``--dtype bfloat16``) with a 32,000-token vocabulary and a 1,024-token context
(:data:`SIZES`), written here in pure JAX with the same leaves and parameter
count (:func:`experiments.lm.model.num_params`, checked) but each block
parameter stacked over the layers and the blocks run under ``jax.lax.scan``
with activation checkpointing (:func:`forward`): the testbed's model unrolls
its blocks and its compiled step grows with the number of leaves (its 2-block
``tiny`` config took 9-39 s per configuration to compile on the shared 2-core
machine; 38 unrolled blocks of 16 leaves each would not fit the 10 minutes the
whole benchmark may take).  Compressors therefore see each stacked leaf (all
the layers of a group, :func:`init_shapes`) as one layer.

**Step**: :func:`compjax.parallel.data_parallel_step` with the parameters and
optimizer state donated (as in a training loop), each device one sequence of
1,024 tokens (``--batch-per-device``), in two layouts:

- ``replicated``: today's 2-D layout (``specs=None``, ``fast_axis="fast"``):
  every device holds the whole parameters, optimizer and compressor state
  (worker axis of ``2 x 4`` over both mesh axes);
- ``sharded``: FSDP over the fast axis (``specs=parallel.fsdp_specs(params, mesh)``):
  parameters and state ``P("data", *spec)``, every large leaf split in 4 along
  its largest dimension; compressors see whole layers (gathered over the fast
  axis), so their temporaries are whole layers.

**Methods** (:data:`METHODS`): ``dense`` (``cj.identity`` then AdamW),
``topk`` (``cj.topk(0.01)`` then AdamW), ``powersgd`` (rank 4, then AdamW),
``dgc`` (``cj.dgc(0.001)`` then AdamW), ``streaming_diloco`` (``cj.diloco``
with an AdamW inner optimizer, ``sync_every=100``, 4 fragments, overlap 1,
4-bit ``cj.e3m0`` outer gradients).

**Numbers** per configuration (bytes of one device): ``argument`` (parameters,
optimizer state and the batch), ``output``, ``alias`` (outputs written into
donated arguments), ``temp`` (XLA's temporaries: activations kept for the
backward pass, gradients, compressor temporaries), ``code`` (0 on XLA:CPU,
whose thunk runtime reports none), and ``peak = argument + output - alias +
temp``: what the compiled program allocates (its arguments, the outputs not
written in place, and one temporary buffer that XLA's liveness-based buffer
assignment sizes).  A
configuration *fits* an 80 GB accelerator when ``peak <= 80e9`` bytes (74.5
GiB, a margin below an 80 GB H100's usable memory for the runtime and the
framework).  Temporaries are XLA:CPU's: a GPU or TPU compiler fuses and
schedules differently (and may rematerialize), so they are an estimate; the
argument bytes are exact for any backend.

Writes ``memory.json`` and ``memory.md`` to ``runs/benchmarks`` (git-ignored),
with ``--publish`` to ``experiments/results/benchmarks``, or to ``--out-dir``;
the JSON holds every number, the command, provenance, the compile time of each
configuration, the load average and the run's wall and CPU time.
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

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 8 simulated CPU devices for the 2 x 4 mesh (before JAX starts).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                               " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from experiments import config_cli, records
from experiments.lm import model as lm_model

PROG = "python -m experiments.benchmarks.memory"
SLOW, FAST = 2, 4
AXIS, FAST_AXIS = "data", "fast"
VOCAB = 32_000
#: Bytes an accelerator offers: 80 GB.
DEVICE_BYTES = 80 * 10**9
GIB = 2**30

#: Model sizes: :class:`experiments.lm.model.CharTransformer` keyword arguments (vocabulary :data:`VOCAB`).
SIZES: dict[str, dict] = {
    "125M": {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024, "groups": 1},
    "1B": {"d_model": 2048, "n_layers": 18, "n_heads": 16, "seq_len": 1024, "groups": 1},
    "8B": {"d_model": 4096, "n_layers": 38, "n_heads": 32, "seq_len": 1024, "groups": 2},
    # For tests: about a second per compile on CPU.
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "groups": 1},
}
TINY_VOCAB = 512


def _adamw():
    return optax.adamw(3e-4, weight_decay=0.1)


#: method -> ``make(axis_name) -> optax transform`` (compressor over the slow axis, then AdamW).
METHODS: dict[str, Callable[[str], optax.GradientTransformation]] = {
    "dense": lambda ax: optax.chain(cj.identity(axis_name=ax), _adamw()),
    "topk": lambda ax: optax.chain(cj.topk(0.01, axis_name=ax), _adamw()),
    "powersgd": lambda ax: optax.chain(cj.powersgd(4, axis_name=ax), _adamw()),
    "dgc": lambda ax: optax.chain(cj.dgc(0.001, momentum=0.9, axis_name=ax), _adamw()),
    "streaming_diloco": lambda ax: cj.diloco(_adamw(), sync_every=100, fragments=4, overlap=1, alpha=0.5,
                                             compressor=cj.e3m0(axis_name=ax, skip_nonfinite=False), axis_name=ax),
}
LAYOUTS = ("replicated", "sharded")
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
    of the depth; groups keep every leaf under 2**31 elements (int32 indices in
    the sparse compressors and in JAX's gathers).

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


def _layer_norm(x, p, eps=1e-6):  # flax.nnx.LayerNorm's default epsilon
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def forward(params: dict, ids, *, n_heads: int, remat: bool = True):
    """Logits ``(B, T, vocab)`` of ``ids`` ``(B, T)``: :class:`experiments.lm.model.CharTransformer`'s computation.

    Token + learned position embeddings, pre-LayerNorm blocks (causal
    multi-head attention, then a 4x GELU MLP, each added to the residual), a
    final LayerNorm and an untied head; the blocks run under ``jax.lax.scan``
    over each group of stacked block parameters, each block rematerialized in the
    backward pass with ``remat`` (only its input is kept: activation
    checkpointing, as large models are trained).
    """
    b, t = ids.shape
    x = params["tok_embed"]["embedding"][ids] + params["pos_embed"]["embedding"][:t]
    causal = jnp.tril(jnp.ones((t, t), bool))

    def block(x, p):
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
    return _layer_norm(x, params["ln_f"]) @ params["head"]["kernel"]


def abstract_model(size: str, dtype=jnp.float32, vocab: int | None = None, remat: bool = True):
    """``(params, loss_fn)``: abstract parameters (nothing allocated) and the LM loss.

    Args:
      size: a key of :data:`SIZES`.
      dtype: the parameters' dtype (float32 or bfloat16); the loss is float32.
      vocab: vocabulary size (default :data:`VOCAB`, :data:`TINY_VOCAB` for ``"tiny"``).
      remat: rematerialize each block in the backward pass.

    Returns:
      params: :func:`init_shapes`' tree of ``jax.ShapeDtypeStruct``.
      loss_fn: ``(params, windows (B, T + 1) int32) -> scalar`` mean next-token cross-entropy (nats).
    """
    vocab = vocab or (TINY_VOCAB if size == "tiny" else VOCAB)
    cfg = SIZES[size]
    params = init_shapes(vocab, **cfg, dtype=dtype)
    count = sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(params))
    expected = lm_model.num_params(vocab, **{k: v for k, v in cfg.items() if k != "groups"})
    if count != expected:  # the testbed's model, leaf for leaf
        raise AssertionError(f"{size}: {count:,} parameters, the testbed's CharTransformer has {expected:,}")

    def loss_fn(p, windows):
        logits = forward(p, windows[:, :-1], n_heads=cfg["n_heads"], remat=remat).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    return params, loss_fn


def _structs(tree, specs, mesh, n):
    """Worker-stacked ``ShapeDtypeStruct`` s: ``(n, *shape)`` with ``NamedSharding(mesh, spec)``."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=NamedSharding(mesh, s)),
                        tree, specs, is_leaf=lambda x: isinstance(x, P))


def _tree_bytes(tree) -> int:
    return int(sum(int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def measure(size: str, method: str, layout: str, mesh, *, dtype=jnp.float32, batch_per_device: int = 1,
            vocab: int | None = None) -> dict:
    """Compile one configuration's training step from abstract inputs and read its memory analysis.

    Args:
      size: a key of :data:`SIZES`.
      method: a key of :data:`METHODS`.
      layout: ``"replicated"`` (``specs=None``) or ``"sharded"`` (``parallel.fsdp_specs``).
      mesh: a ``slow x fast`` mesh (:func:`compjax.parallel.make_2d_mesh`), axes ``"data"`` and ``"fast"``.
      dtype: the parameters' dtype.
      batch_per_device: sequences of ``seq_len + 1`` tokens per device.
      vocab: vocabulary size (see :func:`abstract_model`).

    Returns:
      A dict: ``params`` (count), the per-device bytes of the compiled step
      (``argument``, ``output``, ``alias``, ``temp``, ``code``, ``peak``), the
      logical bytes (one worker, whole) of the parameters (``param_bytes``) and
      optimizer state (``state_bytes``), ``whole_state_bytes`` (per device: the
      leaves held whole by every fast device in the sharded layout, the batch
      included; 0 in the replicated one), ``fits`` and ``compile_s``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    params, loss_fn = abstract_model(size, dtype, vocab)
    tx = METHODS[method](AXIS)
    state = jax.eval_shape(tx.init, params)
    slow, fast = mesh.shape[AXIS], mesh.shape[FAST_AXIS]
    seq = SIZES[size]["seq_len"]
    batch_spec = P((AXIS, FAST_AXIS))
    batch = jax.ShapeDtypeStruct((slow * fast * batch_per_device, seq + 1), jnp.int32,
                                 sharding=NamedSharding(mesh, batch_spec))
    if layout == "sharded":
        specs = parallel.fsdp_specs(params, mesh, fast_axis=FAST_AXIS)
        sspecs = parallel.state_specs(tx, params, specs, mesh)
        stacked = lambda s: P(AXIS, *tuple(s))
        p_in = _structs(params, jax.tree.map(stacked, specs, is_leaf=lambda x: isinstance(x, P)), mesh, slow)
        s_in = _structs(state, jax.tree.map(stacked, sspecs, is_leaf=lambda x: isinstance(x, P)), mesh, slow)
        whole = [x for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(sspecs, is_leaf=lambda x: isinstance(x, P)))
                 if all(e is None for e in tuple(s))]
        whole += [x for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
                  if all(e is None for e in tuple(s))]
        whole_bytes = _tree_bytes(whole) + _tree_bytes(batch) // (slow * fast)
        step = parallel.data_parallel_step(loss_fn, tx, mesh, axis_name=AXIS, fast_axis=FAST_AXIS, specs=specs,
                                           donate=True)
    else:
        spec = P((AXIS, FAST_AXIS))
        p_in = _structs(params, jax.tree.map(lambda _: spec, params), mesh, slow * fast)
        s_in = _structs(state, jax.tree.map(lambda _: spec, state), mesh, slow * fast)
        whole_bytes = 0
        step = parallel.data_parallel_step(loss_fn, tx, mesh, axis_name=AXIS, fast_axis=FAST_AXIS, donate=True)
    t0 = time.perf_counter()
    lowered = step.lower(p_in, s_in, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
    lower_s, compile_s = t1 - t0, time.perf_counter() - t1
    ma = compiled.memory_analysis()
    row = {
        "size": size, "method": method, "layout": layout, "dtype": jnp.dtype(dtype).name,
        "params": int(sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(params))),
        "param_bytes": _tree_bytes(params), "state_bytes": _tree_bytes(state), "whole_state_bytes": whole_bytes,
        "argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes), "temp": int(ma.temp_size_in_bytes),
        "code": int(ma.generated_code_size_in_bytes), "lower_s": lower_s, "compile_s": compile_s,
    }
    row["peak"] = row["argument"] + row["output"] - row["alias"] + row["temp"]
    row["fits"] = row["peak"] <= DEVICE_BYTES
    return row


def _describe(e: Exception) -> str:
    """``Type: first line of the message (at compjax/file.py:line, the innermost compjax frame)``."""
    where = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}compjax{os.sep}" in f.filename]
    at = f" (at {where[-1].filename.rsplit(os.sep + 'compjax' + os.sep, 1)[1]}:{where[-1].lineno})" if where else ""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}{at}"


def run(sizes, methods, layouts=LAYOUTS, *, dtype=jnp.float32, batch_per_device: int = 1, log=None) -> list[dict]:
    """:func:`measure` for every size x method x layout on the ``2 x 4`` mesh; rows in that order.

    A configuration that fails to trace or compile gives a row with ``error``
    (the exception's type and first line) and no byte counts.
    """
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    rows = []
    for size in sizes:
        for method in methods:
            for lay in layouts:
                try:
                    row = measure(size, method, lay, mesh, dtype=dtype, batch_per_device=batch_per_device)
                except Exception as e:  # noqa: BLE001 - recorded in the row, not hidden: the configuration does not build
                    row = {"size": size, "method": method, "layout": lay, "dtype": jnp.dtype(dtype).name,
                           "error": _describe(e)}
                rows.append(row)
                if log and "error" in row:
                    log(f"{size} {method} {lay}: fails: {row['error']}")
                elif log:
                    log(f"{size} {method} {lay}: argument {row['argument'] / GIB:.2f} GiB, temp "
                        f"{row['temp'] / GIB:.2f} GiB, peak {row['peak'] / GIB:.2f} GiB, compile {row['compile_s']:.1f} s")
    return rows


def targets(rows: list[dict], size: str = "1B") -> list[dict]:
    """Sharded argument bytes per device <= replicated / fast + 5%, for every method at ``size``."""
    out = []
    by = {(r["size"], r["method"], r["layout"]): r for r in rows}
    for (s, m, lay), r in by.items():
        if s != size or lay != "sharded" or (s, m, "replicated") not in by:
            continue
        if "error" in r or "error" in by[(s, m, "replicated")]:
            out.append({"target": f"sharded {size} argument bytes <= replicated / {FAST} + 5%", "method": m,
                        "measured": None, "bound": 1.05 / FAST, "met": False})
            continue
        rep = by[(s, m, "replicated")]["argument"]
        ratio = r["argument"] / rep
        out.append({"target": f"sharded {size} argument bytes <= replicated / {FAST} + 5%", "method": m,
                    "measured": ratio, "bound": 1.05 / FAST, "met": r["argument"] <= rep / FAST * 1.05})
    return out


def _gib(x: int) -> str:
    return f"{x / GIB:,.2f}"


def summary(rows: list[dict]) -> list[str]:
    """The short table: per-device peak GiB of each method, replicated -> sharded, per model size (fits or not)."""
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    by = {(r["size"], r["method"], r["layout"]): r for r in rows}
    mark = lambda r: "fails¹" if "error" in r else f"{r['peak'] / GIB:,.1f}" + ("" if r["fits"] else " ✗")
    params = {r["size"]: r["params"] for r in rows if "params" in r}
    lines = ["| method | " + " | ".join(f"{s} ({params[s] / 1e9:.2f}B) replicated → sharded" for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for m in dict.fromkeys(r["method"] for r in rows):
        cells = []
        for s in sizes:
            rep, sh = by.get((s, m, "replicated")), by.get((s, m, "sharded"))
            cells.append(" → ".join(mark(r) if r else "—" for r in (rep, sh)))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict) -> str:
    rows = result["rows"]
    load = result.get("loadavg", {})
    lines = [
        f"Command: `{result['command']}`  ",
        (f"Mesh: {SLOW} x {FAST} simulated CPU devices (jax {result['machine']['jax']}); parameters in "
         f"{result['dtype']}, AdamW moments in the same dtype; {result['batch_per_device']} sequence(s) of "
         f"{{seq_len}} + 1 tokens per device; parameters and optimizer state donated.  "),
        (f"Fits: peak <= {DEVICE_BYTES / 1e9:g} GB ({DEVICE_BYTES / GIB:.1f} GiB) per device.  Per-device GiB "
         "from `compiled.memory_analysis()` (XLA:CPU's buffer assignment; temporaries on GPU/TPU differ).  "),
        (f"Load average before {', '.join(f'{x:.2f}' for x in load.get('before', []))}, after "
         f"{', '.join(f'{x:.2f}' for x in load.get('after', []))}; run took {result.get('wall_s', 0):.0f} s "
         f"({result.get('cpu_s', 0):.0f} s of CPU time)."),
        "",
    ]
    if result.get("targets"):
        lines += ["| target | method | sharded / replicated | bound | met |", "|---|---|---|---|---|"]
        for t in result["targets"]:
            measured = "fails" if t["measured"] is None else f"{t['measured']:.4f}"
            lines.append(f"| {t['target']} | {t['method']} | {measured} | {t['bound']:.4f} | "
                         f"{'yes' if t['met'] else 'no'} |")
        lines.append("")
    lines += [f"Peak GiB per device, replicated → sharded (✗: over {DEVICE_BYTES / 1e9:g} GB):", "",
              *summary(rows), ""]
    errors = list(dict.fromkeys(r["error"] for r in rows if "error" in r))
    if errors:
        lines += ["¹ the step does not build: " + "; ".join(f"`{e}`" for e in errors), ""]
    models = {r["size"]: r["params"] for r in rows if "params" in r}
    lines += ["Models: " + ", ".join(f"{s}: {n:,} parameters ({SIZES[s]['n_layers']} layers, d "
                                     f"{SIZES[s]['d_model']})" for s, n in models.items()), "",
              ("| model | method | layout | argument GiB | output GiB | aliased GiB | temp GiB | code MiB | peak GiB "
               "| fits 80 GB | lower s | compile s |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['method']} | {r['layout']} | fails: {r['error']} |" + " |" * 8)
            continue
        lines.append(f"| {r['size']} | {r['method']} | {r['layout']} | {_gib(r['argument'])} | {_gib(r['output'])} | "
                     f"{_gib(r['alias'])} | {_gib(r['temp'])} | {r['code'] / 2**20:.1f} | {_gib(r['peak'])} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['lower_s']:.1f} | {r['compile_s']:.1f} |")
    seqs = dict.fromkeys(str(SIZES[s]["seq_len"]) for s in models)
    return "\n".join(lines).replace("{seq_len}", "/".join(seqs)) + "\n"


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = config_cli.OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="125M,1B,8B", help=f"comma-separated, of {list(SIZES)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {list(METHODS)}")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the parameters' dtype")
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
    if jax.device_count() < SLOW * FAST:
        p.error(f"needs {SLOW * FAST} devices, found {jax.device_count()} "
                "(XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts)")
    out_dir = records.output_dir(args, "benchmarks")
    command = " ".join([PROG, *argv])
    load_before, t0, c0 = os.getloadavg(), time.perf_counter(), time.process_time()
    rows = run(sizes, methods, dtype=jnp.dtype(args.dtype), batch_per_device=args.batch_per_device,
               log=lambda s: print(s, file=sys.stderr, flush=True))
    result = {"command": command, "dtype": args.dtype, "batch_per_device": args.batch_per_device,
              "mesh": {"slow": SLOW, "fast": FAST}, "device_bytes": DEVICE_BYTES, "vocab": VOCAB,
              "sizes": {s: SIZES[s] for s in sizes}, "methods": methods,
              "machine": {"jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count()},
              "rows": rows, "targets": targets(rows)}
    result["provenance"] = records.provenance(command)
    result["loadavg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    result["wall_s"], result["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(write_markdown(result, out_dir), end="")
    return result


def write_markdown(result: dict, out_dir: Path) -> str:
    """Write ``memory.md`` (everything) and ``memory_peak.md`` (the README's peak table) from ``result``."""
    md = markdown(result)
    (out_dir / "memory.md").write_text(md)
    (out_dir / "memory_peak.md").write_text("\n".join(summary(result["rows"])) + "\n")
    print(f"wrote {out_dir}/memory.{{json,md}} and memory_peak.md", file=sys.stderr)
    return md


if __name__ == "__main__":
    main()
