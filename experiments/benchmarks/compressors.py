"""Compute cost of every compressor: update time on a ResNet-18-shaped tree beside the elementwise floor, and more.

    python -m experiments.benchmarks.compressors [--repeats 10] [--only "topk(0.01),powersgd(rank=2)"] [--small]
    python -m experiments.benchmarks.compressors --repeats 10 --publish --readme README.md   # the committed results

Runs on whatever backend JAX finds (CPU, GPU or TPU) and names the device.
Main table, one worker (``axis_name=None``): the compute cost of compressing
and decoding, no collectives.  The *elementwise floor* is one jitted pass that
reads two trees and writes one (``g + e``, what error feedback costs at least):
a compressor cannot beat memory bandwidth.  Each row also gives the state the
compressor keeps (bytes per parameter) and the peak memory of its update
(XLA's memory analysis of the compiled update: arguments + outputs + temporaries).
Sections: DGC's whole update on one 25M leaf with the sampled threshold vs exact
``lax.top_k``; the random draw alone (threefry vs the counter-based hash);
compile time of the main job's 8-worker step (Fashion-MNIST CNN) with each
compressor beside the dense step's, and that step's time (compute + in-process
collectives on the simulated CPU workers); a donated training step
(compressor + SGD, parameters and state donated as in a training loop) on the
same tree beside plain SGD's, with the non-finite guard on and off; cost
growth from 1M to 64M parameters on one leaf, with the log-log slope per
compressor.  Writes
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
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 8 simulated CPU workers for the multi-worker section (before JAX starts; ignored by GPU/TPU backends).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                               " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()

import jax
import jax.numpy as jnp
import numpy as np

import compjax as cj
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
        med, mn = time_fn(update, g, state, repeats=args.repeats)
        rows.append({"name": name, "ms_median": med, "ms_min": mn, "x_floor": med / f_med})
    speedup = rows[1]["ms_median"] / rows[2]["ms_median"]
    rows[2]["speedup_vs_exact"] = speedup
    rows[2]["note"] = (f"{speedup:.1f}x faster than exact (medians); same entries as exact: "
                       f"{bool(np.array_equal(sent[0], sent[1]))}")
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
    for name in names:
        step, sargs, model = _cnn_step(name, workers, args.small)
        t = time.perf_counter()
        compiled = step.lower(*sargs).compile()
        compile_s = time.perf_counter() - t
        med, mn = time_fn(compiled, *sargs, repeats=args.repeats)
        rows.append({"name": name, "model": model, "workers": workers, "compile_s": compile_s, "ms_median": med,
                     "ms_min": mn})
        print(f"  step {name}: compile {compile_s:.2f} s, {med:.1f} ms", file=sys.stderr, flush=True)
    dense = rows[0]
    for r in rows:
        r["compile_x_dense"] = r["compile_s"] / dense["compile_s"]
        r["x_dense"] = r["ms_median"] / dense["ms_median"]
    return rows


SECTIONS["main-job step (CNN, 8 workers): compile and step time"] = step_section


def train_step_section(args: argparse.Namespace) -> list[dict]:
    """A donated training step on the benchmark tree: ``optax.chain(compressor, optax.sgd(0.1))``, one worker.

    Parameters and optimizer state are donated (``jax.jit(..., donate_argnums=(0, 1))``), as in a training
    loop: the compressor's state is updated in place and its mean feeds the parameter update without a
    buffer of its own.  Beside plain SGD's step (the ``× floor`` column is × that step) and, in the note,
    the same step with the compressor's non-finite guard off (``skip_nonfinite=False``).  Median and min of
    ``--repeats`` blocked steps after 3 warm-up steps.
    """
    import optax

    tree = make_tree(args.small)

    def step_ms(comp) -> tuple[float, float]:
        tx = optax.sgd(0.1) if comp is None else optax.chain(comp, optax.sgd(0.1))

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(step, donate_argnums=(0, 1))
        p = jax.tree.map(jnp.copy, tree)
        s = tx.init(p)
        for _ in range(3):
            p, s = f(p, s, tree)
        jax.block_until_ready((p, s))
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            p, s = f(p, s, tree)
            jax.block_until_ready((p, s))
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times), min(times)

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


def growth_section(args: argparse.Namespace) -> list[dict]:
    """Update time on one leaf of 1M, 4M, 16M and 64M float32 parameters, and the log-log slope per compressor.

    With ``--small``: 2**10 and 2**12 entries (top-k compiles its large-leaf
    path from 2**14 on, seconds per program).  Leaves are (n // 1024, 1024)
    matrices (PowerSGD then has a matrix to factor).  The slope is the
    least-squares fit of log(ms) on log(n); 1 is linear growth.
    """
    sizes = [2**10, 2**12] if args.small else [2**20, 2**22, 2**24, 2**26]
    repeats = max(1, min(args.repeats, 3))
    rng = np.random.default_rng(2)
    base = rng.standard_normal(sizes[-1], np.float32)
    leaves = {n: jnp.asarray(base[:n].reshape(n // 1024, 1024)) for n in sizes}
    rows = []
    for n in sizes:
        g = {"w": leaves[n]}
        med, _ = time_fn(jax.jit(lambda a, b: a + b), g["w"], g["w"], repeats=repeats)
        rows.append({"name": "elementwise floor (g + e)", "size": n, "ms_median": med})
    for name in _names(args):
        tx = COMPRESSORS[name]()
        for n in sizes:
            g = {"w": leaves[n]}
            med, _ = time_fn(jax.jit(tx.update), g, tx.init(g), repeats=repeats)
            rows.append({"name": name, "size": n, "ms_median": med})
        print(f"  growth {name}: done", file=sys.stderr, flush=True)
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


def time_fn(fn, *args, repeats: int) -> tuple[float, float]:
    """Median and min milliseconds of ``fn(*args)`` after one warm-up call (compile)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def floor_ms(tree, repeats: int) -> tuple[float, float]:
    """The elementwise floor: one jitted ``g + e`` over the whole tree."""
    resid = jax.tree.map(lambda x: x * 0.5, tree)
    f = jax.jit(lambda g, e: jax.tree.map(lambda a, b: a + b, g, e))
    return time_fn(f, tree, resid, repeats=repeats)


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


def run(args: argparse.Namespace) -> dict:
    tree = make_tree(args.small)
    n_params = sum(int(x.size) for x in jax.tree.leaves(tree))
    floor_med, floor_min = floor_ms(tree, args.repeats)
    names = _names(args)
    resid = jax.tree.map(lambda x: x * 0.5, tree)
    dense_peak = peak_bytes(jax.jit(lambda g, e: jax.tree.map(lambda a, b: a + b, g, e)).lower(tree, resid).compile())
    rows = [{"name": "elementwise floor (g + e)", "ms_median": floor_med, "ms_min": floor_min, "x_floor": 1.0,
             "payload_bytes": None, "ratio": None, "state_bytes_per_param": None, "peak_bytes": dense_peak}]
    dense = 4 * n_params
    for name in names:
        tx = COMPRESSORS[name]()
        state = tx.init(tree)
        update = jax.jit(tx.update).lower(tree, state).compile()
        _, new_state = jax.block_until_ready(update(tree, state))
        med, mn = time_fn(update, tree, state, repeats=args.repeats)
        nbytes = int(cj.payload_bytes(new_state))
        rows.append({"name": name, "ms_median": med, "ms_min": mn, "x_floor": med / floor_med,
                     "payload_bytes": nbytes, "ratio": dense / nbytes if nbytes else None,
                     "state_bytes_per_param": state_bytes(state) / n_params, "peak_bytes": peak_bytes(update)})
        print(f"  {name}: {med:.1f} ms", file=sys.stderr, flush=True)
    sections = {}
    for sname, fn in SECTIONS.items():
        if sname not in args.skip.split(","):
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


def _mb(x) -> str:
    return f"{x / 2**20:,.0f}" if x is not None else "—"


def markdown(result: dict) -> str:
    m, t = result["machine"], result["tree"]
    load = result.get("loadavg", {})
    lines = [
        f"Command: `{result['command']}`  ",
        f"Tree: {t['name']}-shaped gradients, {t['params']:,} float32 params in {t['leaves']} leaves; one worker.  ",
        (f"Machine: jax {m['jax']} on {m['backend']} ({m['device']}), {m['cpu_count']} CPUs; "
         f"median of {result['repeats']} runs after compilation.  "),
        (f"Load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load.get('before', []))}, "
         f"after {', '.join(f'{x:.2f}' for x in load.get('after', []))}; run took {result.get('wall_s', 0):.0f} s."),
        "",
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
    p.add_argument("--skip", default="", help="comma-separated names of sections to leave out")
    p.add_argument("--small", action="store_true",
                   help="tiny inputs in every section: 11 narrow leaves, a linear model in the step section (tests)")
    records.add_output_arguments(p, "benchmarks")
    p.add_argument("--readme", type=Path, default=None, help="also replace the results:benchmark block of this file")
    args = p.parse_args(argv)
    args.argv = argv
    _names(args)  # an unknown --only name fails here, before any timing
    out_dir = records.output_dir(args, "benchmarks")
    load_before, t0 = os.getloadavg(), time.perf_counter()
    result = run(args)
    result["provenance"] = records.provenance(result["command"])
    result["loadavg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    result["wall_s"] = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compressors.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out_dir / "compressors.md").write_text(md)
    plot(result, out_dir / "compressors.png")
    if args.readme:
        from experiments.results_table import update_readme

        update_readme(args.readme, md, "benchmark")
    print(md, end="")
    print(f"wrote {out_dir}/compressors.{{json,md,png}}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
