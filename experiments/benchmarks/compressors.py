"""Compute cost of every compressor: update time on a ResNet-18-shaped tree beside the elementwise floor, and more.

    python -m experiments.benchmarks.compressors [--repeats 10] [--only "topk(0.01),powersgd(rank=2)"] [--small]
    python -m experiments.benchmarks.compressors --repeats 10 --publish   # the committed results

Runs on whatever backend JAX finds (CPU, GPU or TPU) and names the device.
Main table, one worker (``axis_name=None``): the compute cost of compressing
and decoding, no collectives.  The *elementwise floor* is one jitted pass that
reads two trees and writes one (``g + e``, what error feedback costs at least):
a compressor cannot beat memory bandwidth.  It runs in turn with every row's
calls and its samples are pooled (a shared machine's slow or fast moment does
not scale the whole ``x floor`` column).  Each row also gives the state the
compressor keeps (bytes per parameter) and the peak memory of its update (XLA's memory analysis
of the compiled update: arguments + outputs + temporaries), and where its time
goes: the same update with the non-finite guard off, with error feedback off
too, and for top-k and DGC the threshold selection alone.
Sections: DGC's whole update on one 25M leaf with the sampled threshold vs exact
``lax.top_k`` (and their selections alone, and the page faults per call); the
random draw alone (threefry vs the counter-based hash); compile time of the main
job's 8-worker step (Fashion-MNIST CNN) with each compressor beside the dense
step's (and the update's own compile time), and that step's time (compute +
in-process collectives on the simulated CPU workers); a donated training step
(compressor + SGD, parameters and state donated as in a training loop) on the
same tree beside plain SGD's, with the non-finite guard on and off; cost growth
of that donated step from 1M to 64M parameters on one leaf, with the log-log
slope per compressor.  A **targets** table opens the markdown: each target
(update <= 4x floor, DGC 25M sampled >= 3x exact, <= 1.0x PyTorch from the
``torch_compare.json`` beside the output if that script ran there, compile
<= 2x dense, growth slope in [0.9, 1.15]) with the measured value, met or not,
and for a miss where the time went, from this run's own measurements.  Writes
``compressors.json``, ``compressors.md`` and ``compressors.png`` (update time ×
floor) to ``runs/benchmarks`` (git-ignored), with ``--publish`` to
``experiments/results/benchmarks`` (the committed results), or to
``--out-dir``; the JSON holds the command, provenance and ``os.getloadavg()``
before and after the run.  ``--small`` (tests) shrinks every section: a tree of
11 narrow leaves, small leaves, and a linear model in the step section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from experiments.cpu_devices import force_cpu_devices

if __name__ == "__main__":  # 8 simulated CPU workers for the multi-worker section
    force_cpu_devices(8)

import jax
import jax.numpy as jnp
import numpy as np

import compjax as cj
from compjax.codecs import select
from compjax.codecs.sparse import layer_k
from experiments import config_cli, records

PROG = "python -m experiments.benchmarks.compressors"

#: name -> factory of a transform, ``factory(axis_name=None, **options)`` (e.g. ``skip_nonfinite=False``).
#: Later compressors add a line here.
COMPRESSORS: dict[str, Callable[..., object]] = {
    "identity": lambda axis_name=None, **kw: cj.identity(axis_name=axis_name, **kw),
    "topk(0.01)": lambda axis_name=None, **kw: cj.topk(0.01, axis_name=axis_name, **kw),
    "topk(0.001)": lambda axis_name=None, **kw: cj.topk(0.001, axis_name=axis_name, **kw),
    "randomk(0.01)": lambda axis_name=None, **kw: cj.randomk(0.01, key=0, axis_name=axis_name, **kw),
    "dgc(0.001)": lambda axis_name=None, **kw: cj.dgc(0.001, axis_name=axis_name, **kw),
    "dgc(0.001, exact top-k)": lambda axis_name=None, **kw: cj.dgc(0.001, sample_ratio=None, axis_name=axis_name, **kw),
    "powersgd(rank=2)": lambda axis_name=None, **kw: cj.powersgd(rank=2, axis_name=axis_name, **kw),
    "powersgd(rank=4)": lambda axis_name=None, **kw: cj.powersgd(rank=4, axis_name=axis_name, **kw),
    "onebit": lambda axis_name=None, **kw: cj.onebit(axis_name=axis_name, **kw),
    "twobit(0.5)": lambda axis_name=None, **kw: cj.twobit(0.5, axis_name=axis_name, **kw),
    "terngrad": lambda axis_name=None, **kw: cj.terngrad(key=0, axis_name=axis_name, **kw),
    "qsgd(256)": lambda axis_name=None, **kw: cj.qsgd(256, key=0, axis_name=axis_name, **kw),
    "signsgd": lambda axis_name=None, **kw: cj.signsgd(axis_name=axis_name, **kw),
    "cast(float16)": lambda axis_name=None, **kw: cj.cast(jnp.float16, axis_name=axis_name, **kw),
    "cast(bfloat16)": lambda axis_name=None, **kw: cj.cast(jnp.bfloat16, axis_name=axis_name, **kw),
}

#: compressors whose update selects entries through the threshold (compjax.codecs.select): name -> density.
#: The main table times that selection alone beside the whole update.
SELECTION: dict[str, float] = {"topk(0.01)": 0.01, "topk(0.001)": 0.001, "dgc(0.001)": 0.001}

#: extra sections: name -> function(args) -> list of row dicts (with "name" and "ms_median").
SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {}


def dgc_leaf_section(args: argparse.Namespace, size: int = 25_000_000) -> list[dict]:
    """DGC's whole ``update`` (momentum correction, accumulation, selection, masking, decode) on one leaf.

    One standard normal leaf of ``size`` float32 entries (``size // 1024`` with
    ``--small``), ``dgc(0.001)`` with the sampled threshold and with exact
    ``lax.top_k`` (``sample_ratio=None``), beside the floor on that leaf.
    Both send the same entries here (checked).
    """
    size = size // 1024 if args.small else size
    g = {"w": jnp.asarray(np.random.default_rng(1).standard_normal(size, np.float32))}
    f_med, f_min = time_fn(jax.jit(lambda a, b: a + b), g["w"], g["w"] * 0.5, repeats=args.repeats)
    rows = [{"name": f"elementwise floor (g + e), {size:,} entries", "ms_median": f_med, "ms_min": f_min,
             "x_floor": 1.0}]
    sent = []
    for name, tx in [("dgc(0.001), exact lax.top_k", cj.dgc(0.001, sample_ratio=None)),
                     ("dgc(0.001), sampled threshold", cj.dgc(0.001))]:
        update = jax.jit(tx.update)
        state = tx.init(g)
        sent.append(np.flatnonzero(np.asarray(update(g, state)[0]["w"])))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        med, mn = time_fn(update, g, state, repeats=args.repeats)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / (args.repeats + 1)
        rows.append({"name": name, "ms_median": med, "ms_min": mn, "x_floor": med / f_med,
                     "page_faults_per_call": faults})
    speedup = rows[1]["ms_median"] / rows[2]["ms_median"]
    rows[2]["speedup_vs_exact"] = speedup
    rows[2]["note"] = (f"{speedup:.1f}x faster than exact (medians); same entries as exact: "
                       f"{bool(np.array_equal(sent[0], sent[1]))}; "
                       f"{rows[2]['page_faults_per_call']:,.0f} minor page faults per call")
    # The selection alone, on the same |v|: what the sampled threshold saves, beside what both updates share.
    k = layer_k(size, 0.001)
    for name, fn in [("selection alone, exact lax.top_k", jax.jit(lambda x: jax.lax.top_k(jnp.abs(x), k))),
                     ("selection alone, sampled threshold", jax.jit(lambda x: select.topk(x, k)))]:
        med, mn = time_fn(fn, g["w"], repeats=args.repeats)
        rows.append({"name": name, "ms_median": med, "ms_min": mn, "x_floor": med / f_med})
    sel_speedup = rows[3]["ms_median"] / rows[4]["ms_median"]
    rows[4]["note"] = f"{sel_speedup:.1f}x faster than exact (medians)"
    rows[4]["speedup_vs_exact"] = sel_speedup
    return rows


SECTIONS["dgc(0.001) whole update on one 25M leaf"] = dgc_leaf_section


def draw_section(args: argparse.Namespace) -> list[dict]:
    """One uniform draw per parameter: ``jax.random.uniform`` (threefry) vs the counter-based hash, beside the floor.

    Both summed so that the draw is not optimised away.  The hash
    (:mod:`compjax.codecs.random`) is what TernGrad, QSGD and random-k draw
    (:func:`compjax.compressors.keys.step_uniforms`).
    """
    from compjax.codecs import random as cr

    tree = make_tree(args.small)
    n = sum(int(x.size) for x in jax.tree.leaves(tree))
    f_med, f_min = floor_ms(tree, args.repeats)
    rows = [{"name": "elementwise floor (g + e)", "ms_median": f_med, "ms_min": f_min, "x_floor": 1.0}]
    for name, fn, arg in [
        (f"jax.random.uniform, {n:,} float32 (threefry)",
         jax.jit(lambda key: jnp.sum(jax.random.uniform(key, (n,), jnp.float32))), jax.random.PRNGKey(0)),
        (f"counter-based hash (compjax.codecs.random), {n:,} float32",
         jax.jit(lambda key: jnp.sum(cr.uniform(cr.stream(key, 0, 0), n))), jax.random.PRNGKey(0)),
    ]:
        med, mn = time_fn(fn, arg, repeats=args.repeats)
        rows.append({"name": name, "ms_median": med, "ms_min": mn, "x_floor": med / f_med})
    return rows


SECTIONS["one uniform draw per parameter"] = draw_section


def _linear_model():
    """``(params, loss_fn)`` of a softmax regression on 28x28x1 images: the step section's model with ``--small``."""
    import optax

    params = {"w": jnp.zeros((784, 10), jnp.float32), "b": jnp.zeros(10, jnp.float32)}

    def loss_fn(p, batch):
        x, y = batch
        logits = x.reshape(x.shape[0], -1) @ p["w"] + p["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return params, loss_fn


def _step_params(small: bool = False):
    """The parameters of the step section's model (the CNN, or with ``small`` the softmax regression)."""
    from experiments import models

    return _linear_model()[0] if small else models.build(0)[0]


def _cnn_step(name: str, workers: int, small: bool = False):
    """The main job's data-parallel step (Fashion-MNIST CNN, global batch 256) with compressor ``name``, then SGD.

    ``small``: a softmax regression instead of the CNN and a global batch of 8 per worker (seconds to compile).
    Returns the jitted step, its arguments and the model's name.
    """
    import optax

    from compjax import parallel
    from experiments import models

    params, loss_fn = _linear_model() if small else models.build(0)[::2]
    batch_size = 8 * workers if small else 256
    mesh = parallel.make_mesh(workers)
    tx = optax.chain(COMPRESSORS[name](axis_name="data"), optax.sgd(0.05, momentum=0.9))
    p = parallel.replicate(params, mesh)
    s = parallel.init_worker_state(tx, params, mesh)
    rng = np.random.default_rng(0)
    batch = parallel.shard_batch((rng.standard_normal((batch_size, 28, 28, 1)).astype(np.float32),
                                  rng.integers(0, 10, batch_size).astype(np.int32)), mesh)
    step = parallel.data_parallel_step(loss_fn, tx, mesh)
    return step, (p, s, batch), "softmax regression (small)" if small else "CNN"


def step_section(args: argparse.Namespace) -> list[dict]:
    """Compile time and step time of the main job's 8-worker step per compressor, beside the dense (identity) step.

    Compile: ``step.lower(...).compile()`` wall time, once per compressor.  Step:
    median of ``--repeats`` blocked steps (compute + the in-process collectives of
    the simulated CPU workers: the wire is free here).  Uses the devices JAX has
    (8 simulated CPU devices when run as ``python -m``), at most 8.  With
    ``--small``: a softmax regression on 8 images per worker (the rows' ``model``).
    """
    workers = min(8, len(jax.devices()))
    names = _names(args)
    if "identity" not in names:
        names = ["identity", *names]
    rows = []
    params = _step_params(args.small)  # one worker's parameters, for the update's own compile time
    for name in names:
        step, sargs, model = _cnn_step(name, workers, args.small)
        t = time.perf_counter()
        compiled = step.lower(*sargs).compile()
        compile_s = time.perf_counter() - t
        med, mn = time_fn(compiled, *sargs, repeats=args.repeats)
        tx = COMPRESSORS[name]()  # its update alone, on one worker's parameters
        t = time.perf_counter()
        jax.jit(tx.update).lower(params, tx.init(params)).compile()
        update_compile_s = time.perf_counter() - t
        rows.append({"name": name, "model": model, "workers": workers, "compile_s": compile_s, "ms_median": med,
                     "ms_min": mn, "update_compile_s": update_compile_s})
        print(f"  step {name}: compile {compile_s:.2f} s, {med:.1f} ms", file=sys.stderr, flush=True)
    dense = rows[0]
    for r in rows:
        r["compile_x_dense"] = r["compile_s"] / dense["compile_s"]
        r["x_dense"] = r["ms_median"] / dense["ms_median"]
    return rows


SECTIONS["main-job step (CNN, 8 workers): compile and step time"] = step_section


def donated_step_ms(tree, comp, repeats: int, warmup: int = 3) -> tuple[float, float]:
    """Median and min ms of a donated training step on ``tree``: ``chain(comp, sgd(0.1))``, or SGD alone (None).

    Parameters and optimizer state are donated (``jax.jit(..., donate_argnums=(0, 1))``), as in a training
    loop: no step allocates a buffer for its state or its parameters.  ``warmup`` steps first (compile).
    """
    import optax

    tx = optax.sgd(0.1) if comp is None else optax.chain(comp, optax.sgd(0.1))

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    f = jax.jit(step, donate_argnums=(0, 1))
    p = jax.tree.map(jnp.copy, tree)
    s = tx.init(p)
    for _ in range(warmup):
        p, s = f(p, s, tree)
    jax.block_until_ready((p, s))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        p, s = f(p, s, tree)
        jax.block_until_ready((p, s))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def train_step_section(args: argparse.Namespace) -> list[dict]:
    """A donated training step on the benchmark tree: ``optax.chain(compressor, optax.sgd(0.1))``, one worker.

    Parameters and optimizer state are donated (``jax.jit(..., donate_argnums=(0, 1))``), as in a training
    loop: the compressor's state is updated in place and its mean feeds the parameter update without a
    buffer of its own.  Beside plain SGD's step (the ``× floor`` column is × that step) and, in the note,
    the same step with the compressor's non-finite guard off (``skip_nonfinite=False``).  Median and min of
    ``--repeats`` blocked steps after 3 warm-up steps (:func:`donated_step_ms`).
    """
    tree = make_tree(args.small)

    def step_ms(comp):
        return donated_step_ms(tree, comp, args.repeats)

    base_med, base_min = step_ms(None)
    rows = [{"name": "SGD step alone (no compressor)", "ms_median": base_med, "ms_min": base_min, "x_floor": 1.0}]
    for name in _names(args):
        med, mn = step_ms(COMPRESSORS[name]())
        off, _ = step_ms(COMPRESSORS[name](skip_nonfinite=False))
        rows.append({"name": name, "ms_median": med, "ms_min": mn, "x_floor": med / base_med, "guard_off_ms": off,
                     "note": f"guard off: {off:.1f} ms"})
        print(f"  train step {name}: {med:.1f} ms (guard off {off:.1f} ms)", file=sys.stderr, flush=True)
    return rows


SECTIONS["donated training step (compressor + SGD), one worker"] = train_step_section


#: The growth section's last row: the elementwise floor with a fresh output buffer per call (not donated).
NOT_DONATED = "elementwise floor (g + e), not donated"


def growth_section(args: argparse.Namespace) -> list[dict]:
    """Donated training-step time on one leaf of 1M, 4M, 16M and 64M float32 parameters, and the log-log slope.

    Each row is :func:`donated_step_ms` of ``chain(compressor, sgd)`` on one leaf, the floor row SGD's step
    alone (one elementwise pass), median of ``--repeats`` steps.  Donated, because an update that returns
    fresh buffers measures the allocator beyond 32 MiB: glibc maps such buffers afresh at every call, and
    their page faults (one per 4 KiB) cost more than the pass itself.  The last row shows it: a non-donated
    ``g + e`` (:data:`NOT_DONATED`) on the same leaves; the targets leave it out.
    With ``--small``: 2**10 and 2**12 entries (top-k compiles its large-leaf path from 2**14 on, seconds
    per program).  Leaves are (n // 1024, 1024) matrices (PowerSGD then has a matrix to factor).  The
    slope is the least-squares fit of log(ms) on log(n); 1 is linear growth.
    """
    sizes = [2**10, 2**12] if args.small else [2**20, 2**22, 2**24, 2**26]
    rng = np.random.default_rng(2)
    base = rng.standard_normal(sizes[-1], np.float32)
    leaves = {n: jnp.asarray(base[:n].reshape(n // 1024, 1024)) for n in sizes}
    rows = []
    for name in ["elementwise floor (SGD step)", *_names(args)]:
        for n in sizes:
            comp = None if name.startswith("elementwise floor") else COMPRESSORS[name]()
            med, mn = donated_step_ms({"w": leaves[n]}, comp, args.repeats)
            rows.append({"name": name, "size": n, "ms_median": med, "ms_min": mn})
        print(f"  growth {name}: done", file=sys.stderr, flush=True)
    for n in sizes:  # why the steps are donated: a fresh output buffer per call
        med, mn = time_fn(jax.jit(lambda a, b: a + b), leaves[n], leaves[n], repeats=args.repeats)
        rows.append({"name": NOT_DONATED, "size": n, "ms_median": med, "ms_min": mn})
    for name in dict.fromkeys(r["name"] for r in rows):
        pts = [(math.log(r["size"]), math.log(r["ms_median"])) for r in rows if r["name"] == name]
        slope = float(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0])
        for r in rows:
            if r["name"] == name:
                r["slope"] = slope
    return rows


SECTIONS["cost growth, 1M to 64M parameters on one leaf"] = growth_section


def resnet18_shapes(num_classes: int = 1000, small: bool = False) -> dict[str, tuple[int, ...]]:
    """Leaf shapes of ResNet-18 (He et al. 2016) for 224x224 ImageNet, in flax layout (11,689,512 params).

    Convs ``(kh, kw, in, out)`` without bias, batch-norm scale and bias per conv,
    the final dense ``(512, num_classes)`` + bias.  ``small`` divides widths by 16.
    """
    div = 16 if small else 1
    w = [64 // div, 128 // div, 256 // div, 512 // div]
    shapes = {"conv1/kernel": (7, 7, 3, w[0]), "bn1/scale": (w[0],), "bn1/bias": (w[0],)}
    cin = w[0]
    for stage, cout in enumerate(w):
        for block in range(2):
            stride = 2 if (stage > 0 and block == 0) else 1
            p = f"layer{stage + 1}/{block}"
            shapes[f"{p}/conv1/kernel"] = (3, 3, cin, cout)
            shapes[f"{p}/bn1/scale"] = shapes[f"{p}/bn1/bias"] = (cout,)
            shapes[f"{p}/conv2/kernel"] = (3, 3, cout, cout)
            shapes[f"{p}/bn2/scale"] = shapes[f"{p}/bn2/bias"] = (cout,)
            if stride != 1 or cin != cout:
                shapes[f"{p}/downsample/kernel"] = (1, 1, cin, cout)
                shapes[f"{p}/downsample/bn/scale"] = shapes[f"{p}/downsample/bn/bias"] = (cout,)
            cin = cout
    shapes["fc/kernel"] = (w[3], num_classes // (10 if small else 1))
    shapes["fc/bias"] = (num_classes // (10 if small else 1),)
    return shapes


#: the leaves of the --small tree: the stem, the first block and the classifier of the 16x-narrower ResNet-18.
SMALL_LEAVES = ("conv1/", "bn1/", "layer1/0/", "fc/")


def tree_shapes(small: bool) -> dict[str, tuple[int, ...]]:
    """The benchmark tree's leaf shapes: ResNet-18's, or with ``small`` the :data:`SMALL_LEAVES` of it 16x narrower.

    The small tree (11 leaves, tests) keeps compile times to seconds: compiling an update costs per leaf.
    """
    shapes = resnet18_shapes(small=small)
    return {k: s for k, s in shapes.items() if k.startswith(SMALL_LEAVES)} if small else shapes


def make_tree(small: bool, seed: int = 0) -> dict[str, jnp.ndarray]:
    rng = np.random.default_rng(seed)  # NumPy: one jax.random compile per leaf shape would take a minute
    return {k: jnp.asarray(rng.standard_normal(s, np.float32)) for k, s in tree_shapes(small).items()}


def time_samples(fn, *args, repeats: int) -> list[float]:
    """Milliseconds of ``repeats`` blocked calls of ``fn(*args)`` after one warm-up call (compile)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return times


def time_interleaved(calls: dict, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of ``repeats`` rounds in which every ``calls[name] = (fn, args)`` runs once, in turn.

    Each call is warmed up (compiled) first.  Interleaving makes the calls share the machine's slow and fast
    moments, so that differences between them (the cost of a part turned off) are not differences between
    two moments of a shared machine.
    """
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - t) * 1e3)
    return times


def time_fn(fn, *args, repeats: int) -> tuple[float, float]:
    """Median and min milliseconds of ``fn(*args)`` after one warm-up call (compile)."""
    times = time_samples(fn, *args, repeats=repeats)
    return statistics.median(times), min(times)


def floor_fn():
    """The elementwise floor: one jitted ``g + e`` over a whole tree (call it on ``(tree, residual)``)."""
    return jax.jit(lambda g, e: jax.tree.map(lambda a, b: a + b, g, e))


def floor_ms(tree, repeats: int) -> tuple[float, float]:
    """Median and min ms of the elementwise floor on ``tree``."""
    return time_fn(floor_fn(), tree, jax.tree.map(lambda x: x * 0.5, tree), repeats=repeats)


def update_calls(name: str, tree) -> dict:
    """The calls timed beside compressor ``name``'s update, ``{key: (jitted fn, args)}`` for :func:`time_interleaved`.

    ``"guard_off"``: its update with ``skip_nonfinite=False``; ``"ef_off"``: also with
    ``error_feedback=False`` (left out when the compressor has no such option: its residual is part of the
    method); ``"selection"``: for the compressors of :data:`SELECTION`, the threshold selection alone
    (:func:`compjax.codecs.select.topk_many` over every leaf at that density).
    """
    calls = {}
    for key, kw in (("guard_off", {"skip_nonfinite": False}),
                    ("ef_off", {"skip_nonfinite": False, "error_feedback": False})):
        try:
            tx = COMPRESSORS[name](**kw)
        except TypeError:  # no such option
            continue
        calls[key] = (jax.jit(tx.update), (tree, tx.init(tree)))
    if name in SELECTION:
        leaves = jax.tree.leaves(tree)
        ks = [layer_k(int(x.size), SELECTION[name]) for x in leaves]
        calls["selection"] = (jax.jit(lambda xs: select.topk_many(xs, ks)), (leaves,))
    return calls


def _names(args: argparse.Namespace) -> list[str]:
    """The compressors that ``--only`` names (all without it).

    Raises:
      SystemExit: a name in ``--only`` that is not a compressor of :data:`COMPRESSORS`.
    """
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else []
    unknown = [n for n in only if n not in COMPRESSORS]
    if unknown:
        raise SystemExit(f"--only: unknown compressor(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(COMPRESSORS)}")
    return [n for n in COMPRESSORS if not only or n in only]


def device_info() -> dict:
    """The backend JAX runs on and the device's name (e.g. ``gpu``, ``NVIDIA H100 80GB HBM3``)."""
    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": d.device_kind, "devices": len(jax.devices()),
            "platform_version": getattr(d.client, "platform_version", "")}


def state_bytes(state) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype"))


def peak_bytes(compiled) -> int | None:
    """Arguments + outputs + temporaries of a compiled function (XLA's memory analysis), or None if unknown."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - getattr(m, "alias_size_in_bytes", 0))
    except Exception:  # noqa: BLE001 -- not every backend reports it
        return None


def skipped(section: str, skip: str) -> bool:
    """Whether ``--skip`` names ``section``: its whole name between commas (or the ends) of ``skip``; a section
    name may hold commas itself (``"cost growth, 1M to 64M parameters on one leaf"``).

    Examples:
      >>> skipped("cost growth, 1M to 64M parameters on one leaf", "one uniform draw per parameter,cost growth, 1M "
      ...         "to 64M parameters on one leaf")
      True
      >>> skipped("cost growth, 1M to 64M parameters on one leaf", "cost growth")
      False
    """
    return f",{section}," in f",{skip},"


def run(args: argparse.Namespace) -> dict:
    """The main table (one row per compressor, the floor first) and every section of :data:`SECTIONS`.

    Each row's calls (:func:`update_calls`) and the floor run in turn, ``--repeats`` rounds
    (:func:`time_interleaved`); the floor's samples are pooled over the rows: its median and min (the
    floor row) are those of all ``--repeats`` x (compressors + 1) samples, so that one slow or fast
    moment of a shared machine does not scale a whole column of ``x floor``.
    """
    tree = make_tree(args.small)
    n_params = sum(int(x.size) for x in jax.tree.leaves(tree))
    names = _names(args)
    resid = jax.tree.map(lambda x: x * 0.5, tree)
    floor = floor_fn()
    dense_peak = peak_bytes(floor.lower(tree, resid).compile())
    floor_samples = time_samples(floor, tree, resid, repeats=args.repeats)
    rows = []
    dense = 4 * n_params
    for name in names:
        tx = COMPRESSORS[name]()
        state = tx.init(tree)
        update = jax.jit(tx.update).lower(tree, state).compile()
        _, new_state = jax.block_until_ready(update(tree, state))
        calls = {"floor": (floor, (tree, resid)), "update": (update, (tree, state)), **update_calls(name, tree)}
        times = time_interleaved(calls, args.repeats)
        floor_samples += times["floor"]
        med = {k: statistics.median(v) for k, v in times.items()}
        nbytes = int(cj.message_bytes(new_state))  # one worker (axis_name=None): the message it would send
        rows.append({"name": name, "ms_median": med["update"], "ms_min": min(times["update"]),
                     "payload_bytes": nbytes, "ratio": dense / nbytes if nbytes else None,
                     "state_bytes_per_param": state_bytes(state) / n_params, "peak_bytes": peak_bytes(update),
                     "guard_off_ms": med.get("guard_off"), "ef_off_ms": med.get("ef_off"),
                     "selection_ms": med.get("selection")})
        print(f"  {name}: {med['update']:.1f} ms", file=sys.stderr, flush=True)
    floor_med = statistics.median(floor_samples)
    for r in rows:
        r["x_floor"] = r["ms_median"] / floor_med
    rows.insert(0, {"name": "elementwise floor (g + e)", "ms_median": floor_med, "ms_min": min(floor_samples),
                    "x_floor": 1.0, "payload_bytes": None, "ratio": None, "state_bytes_per_param": None,
                    "peak_bytes": dense_peak, "samples": len(floor_samples)})
    sections = {}
    for sname, fn in SECTIONS.items():
        if not skipped(sname, args.skip):
            sections[sname] = fn(args)
    return {
        "command": shlex.join([*PROG.split(), *args.argv]),
        "machine": {"jax": jax.__version__, **device_info(), "cpu_count": os.cpu_count(),
                    "platform": platform.platform()},
        "tree": {"name": "ResNet-18 (small: stem, first block, classifier)" if args.small else "ResNet-18",
                 "params": n_params, "leaves": len(jax.tree.leaves(tree))},
        "repeats": args.repeats,
        "rows": rows,
        "sections": sections,
    }


#: The targets the results are checked against (reported met or missed, with why for a miss).
FLOOR_TARGET, DGC_SPEEDUP_TARGET, TORCH_TARGET, COMPILE_TARGET, SLOPE_TARGET = 4.0, 3.0, 1.0, 2.0, (0.9, 1.15)


def _why_update(r: dict, floor_ms: float) -> str:
    """Where a main-table row's time goes, from :func:`update_calls` timed in turn (differences of medians)."""
    parts = []
    if r.get("guard_off_ms") is not None:
        parts.append(f"non-finite guard {r['ms_median'] - r['guard_off_ms']:+.1f} ms")
        rest = r["guard_off_ms"]
        if r.get("ef_off_ms") is not None:
            parts.append(f"error feedback {r['guard_off_ms'] - r['ef_off_ms']:+.1f} ms")
            rest = r["ef_off_ms"]
        parts.append(f"compression, exchange and decode {rest:.1f} ms ({rest / floor_ms:.1f}x floor)")
    if r.get("selection_ms") is not None:
        parts.append(f"of which the threshold selection alone {r['selection_ms']:.1f} ms "
                     f"({r['selection_ms'] / floor_ms:.1f}x floor)")
    return "; ".join(parts)


def targets(result: dict, torch: dict | None = None) -> list[dict]:
    """Each target of the benchmark with what this run measured: ``{"target", "row", "measured", "met", "why"}``.

    Targets: every update <= 4x the elementwise floor (median); DGC's whole update on a 25M leaf >= 3x faster
    with the sampled threshold than with exact ``lax.top_k``; ``cj.powersgd`` and ``cj.topk`` <= 1.0x the
    PyTorch time (``torch``: the ``torch_compare.json`` of the same output folder, if that script ran); the
    8-worker step's compile time <= 2x the dense step's; a growth slope in [0.9, 1.15].  ``why`` (for a
    miss) comes from the same run's measurements.
    """
    out = []
    rows, sections = result["rows"], result["sections"]
    floor = rows[0]["ms_median"]
    for r in rows[1:]:
        met = r["x_floor"] <= FLOOR_TARGET
        out.append({"target": f"update <= {FLOOR_TARGET:g}x floor", "row": r["name"],
                    "measured": f"{r['x_floor']:.1f}x (min {r['ms_min'] / rows[0]['ms_min']:.1f}x)", "met": met,
                    "why": "" if met else _why_update(r, floor)})
    dgc = sections.get("dgc(0.001) whole update on one 25M leaf")
    if dgc:
        sp = dgc[2]["speedup_vs_exact"]
        met = sp >= DGC_SPEEDUP_TARGET
        why = ""
        if not met and len(dgc) > 4:
            shared = dgc[2]["ms_median"] - dgc[4]["ms_median"]
            why = (f"the selection alone is {dgc[4]['speedup_vs_exact']:.1f}x faster sampled "
                   f"({dgc[3]['ms_median']:.1f} vs {dgc[4]['ms_median']:.1f} ms); the rest of the sampled update "
                   f"(momentum correction, accumulation, masking, decode) takes {shared:.1f} ms "
                   f"({shared / dgc[0]['ms_median']:.1f}x floor), the same work in both")
            if dgc[2].get("page_faults_per_call") is not None:
                why += (f", with {dgc[2]['page_faults_per_call']:,.0f} minor page faults per call "
                        "(its temporaries of this leaf's size are mapped afresh at every call)")
        out.append({"target": f"dgc 25M sampled >= {DGC_SPEEDUP_TARGET:g}x faster than exact",
                    "row": "dgc(0.001), 25M leaf", "measured": f"{sp:.1f}x", "met": met, "why": why})
    for t in (torch or {}).get("rows", []):
        met = t["ratio"] <= TORCH_TARGET
        out.append({"target": f"<= {TORCH_TARGET:g}x PyTorch", "row": t["what"], "measured": f"{t['ratio']:.2f}x",
                    "met": met, "why": "" if met else f"{t['compjax_ms']:.1f} ms vs torch {t['torch_ms']:.1f} ms"})
    for r in sections.get("main-job step (CNN, 8 workers): compile and step time", [])[1:]:
        met = r["compile_x_dense"] <= COMPILE_TARGET
        why = "" if met else f"the update alone compiles in {r['update_compile_s']:.2f} s of the step's {r['compile_s']:.2f} s"
        out.append({"target": f"step compile <= {COMPILE_TARGET:g}x dense", "row": r["name"],
                    "measured": f"{r['compile_x_dense']:.2f}x", "met": met, "why": why})
    growth = sections.get("cost growth, 1M to 64M parameters on one leaf", [])
    if growth:
        lo, hi = SLOPE_TARGET
        floor_slope = growth[0]["slope"]
        for name in dict.fromkeys(r["name"] for r in growth[1:] if r["name"] not in (growth[0]["name"], NOT_DONATED)):
            by = {r["size"]: r for r in growth if r["name"] == name}
            fl = {r["size"]: r for r in growth if r["name"] == growth[0]["name"]}
            a, b = min(by), max(by)
            slope = by[a]["slope"]
            met = lo <= slope <= hi
            why = "" if met else (f"x the SGD step {by[a]['ms_median'] / fl[a]['ms_median']:.1f} at {a / 2**20:g}M, "
                                  f"{by[b]['ms_median'] / fl[b]['ms_median']:.1f} at {b / 2**20:g}M; "
                                  f"the SGD step's own slope {floor_slope:.2f}")
            out.append({"target": f"growth slope in [{lo:g}, {hi:g}]", "row": name, "measured": f"{slope:.3f}",
                        "met": met, "why": why})
    return out


def _mb(x) -> str:
    return f"{x / 2**20:,.0f}" if x is not None else "—"


def _targets_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    met = sum(r["met"] for r in rows)
    lines = [f"**Targets**: {met} of {len(rows)} met in this run.", "",
             "| target | row | measured | met | why (when missed) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['row']} | {r['measured']} | {'yes' if r['met'] else 'no'} | {r['why']} |")
    return [*lines, ""]


def markdown(result: dict) -> str:
    m, t = result["machine"], result["tree"]
    load = result.get("loadavg", {})
    lines = [
        f"Command: `{result['command']}`  ",
        f"Tree: {t['name']}-shaped gradients, {t['params']:,} float32 params in {t['leaves']} leaves; one worker.  ",
        (f"Machine: jax {m['jax']} on {m['backend']} ({m['device']}), {m['cpu_count']} CPUs; "
         f"median of {result['repeats']} runs after compilation (the floor: of its "
         f"{result['rows'][0].get('samples', result['repeats'])} runs, in turn with every row's calls).  "),
        (f"Load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load.get('before', []))}, "
         f"after {', '.join(f'{x:.2f}' for x in load.get('after', []))}; run took {result.get('wall_s', 0):.0f} s."),
        "",
        *_targets_markdown(result.get("targets", [])),
        ("| update | median ms | min ms | × floor | payload bytes | ratio vs identity | state bytes/param "
         "| peak MiB of the update |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        nb = f"{r['payload_bytes']:,}" if r["payload_bytes"] is not None else "—"
        ratio = f"{r['ratio']:.1f}×" if r["ratio"] else "—"
        sb = f"{r['state_bytes_per_param']:.2f}" if r.get("state_bytes_per_param") is not None else "—"
        lines.append(f"| {r['name']} | {r['ms_median']:.2f} | {r['ms_min']:.2f} | {r['x_floor']:.1f} | {nb} | "
                     f"{ratio} | {sb} | {_mb(r.get('peak_bytes'))} |")
    ms = lambda x: "—" if x is None else f"{x:.2f}"
    lines += ["", "**where the update's time goes** (medians of the same update with parts turned off)", "",
              "| update | whole ms | guard off ms | guard and error feedback off ms | threshold selection alone ms |",
              "|---|---|---|---|---|"]
    for r in result["rows"][1:]:
        lines.append(f"| {r['name']} | {r['ms_median']:.2f} | {ms(r.get('guard_off_ms'))} | "
                     f"{ms(r.get('ef_off_ms'))} | {ms(r.get('selection_ms'))} |")
    for sname, rows in result["sections"].items():
        lines += ["", f"**{sname}**", ""]
        if rows and "compile_s" in rows[0]:
            lines += ["| compressor | workers | compile s | × dense compile | step ms (median) | × dense step |",
                      "|---|---|---|---|---|---|"]
            for r in rows:
                lines.append(f"| {r['name']} | {r['workers']} | {r['compile_s']:.2f} | {r['compile_x_dense']:.2f} | "
                             f"{r['ms_median']:.1f} | {r['x_dense']:.2f} |")
        elif rows and "size" in rows[0]:
            sizes = sorted({r["size"] for r in rows})
            lines += ["| update | " + " | ".join(f"{n / 2**20:g}M ms" for n in sizes) + " | log-log slope |",
                      "|---|" + "---|" * (len(sizes) + 1)]
            for name in dict.fromkeys(r["name"] for r in rows):
                by = {r["size"]: r for r in rows if r["name"] == name}
                lines.append(f"| {name} | " + " | ".join(f"{by[n]['ms_median']:.1f}" for n in sizes)
                             + f" | {by[sizes[0]]['slope']:.2f} |")
        else:
            lines += ["| what | median ms | min ms | × floor | note |", "|---|---|---|---|---|"]
            for r in rows:
                lines.append(f"| {r['name']} | {r['ms_median']:.2f} | {r['ms_min']:.2f} | {r['x_floor']:.1f} | "
                             f"{r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path, others: tuple[dict, ...] = ()) -> bool:
    """Bar chart of update time × floor per compressor (one bar group per result: e.g. CPU and GPU).

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = (result, *others)
    names = [r["name"] for r in result["rows"][1:]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(results)
    for j, res in enumerate(results):
        by = {r["name"]: r["x_floor"] for r in res["rows"]}
        ax.bar([i + j * width for i in range(len(names))], [by.get(n, 0) for n in names], width,
               label=f"{res['machine']['backend']} ({res['machine']['device']})")
    ax.axhline(4, color="k", ls="--", lw=0.8, label="target: 4× floor")
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(names))], names, rotation=45, ha="right")
    ax.set_ylabel("update time × elementwise floor")
    ax.set_yscale("log")
    ax.set_title(f"Compressor update on {result['tree']['name']} ({result['tree']['params']:,} params), one worker")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = config_cli.OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--only", default="", help="comma-separated names of compressors as in the table, e.g. "
                   "'topk(0.01),onebit' (all sections use them; an unknown name is an error)")
    p.add_argument("--skip", default="", help="comma-separated names of sections to leave out, each whole "
                   "(the names hold commas of their own: e.g. 'cost growth, 1M to 64M parameters on one leaf')")
    p.add_argument("--small", action="store_true",
                   help="tiny inputs in every section: 11 narrow leaves, a linear model in the step section (tests)")
    records.add_output_arguments(p, "benchmarks")
    args = p.parse_args(argv)
    args.argv = argv
    _names(args)  # an unknown --only name fails here, before any timing
    out_dir = records.output_dir(args, "benchmarks")
    load_before, t0 = os.getloadavg(), time.perf_counter()
    result = run(args)
    result["provenance"] = records.provenance(result["command"])
    result["loadavg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    result["wall_s"] = time.perf_counter() - t0
    torch_json = out_dir / "torch_compare.json"
    result["targets"] = targets(result, json.loads(torch_json.read_text()) if torch_json.exists() else None)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compressors.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out_dir / "compressors.md").write_text(md)
    plot(result, out_dir / "compressors.png")
    print(md, end="")
    print(f"wrote {out_dir}/compressors.{{json,md,png}}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
