"""Jitted update time of each compressor on a ResNet-18-shaped gradient tree, beside the elementwise floor.

    python -m experiments.benchmarks.compressors [--repeats 10] [--only topk,powersgd] [--small]

One worker (``axis_name=None``): the compute cost of compressing and decoding,
no collectives.  The *elementwise floor* is one jitted pass that reads two trees
and writes one (``g + e``, what error feedback costs at least): a compressor
cannot beat memory bandwidth.  Writes ``compressors.json`` and
``compressors.md`` to ``--out-dir`` (default ``experiments/results/benchmarks``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import compjax as cj

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE.parent / "results" / "benchmarks"

#: name -> factory of a one-worker transform.  Later compressors add a line here.
COMPRESSORS: dict[str, Callable[[], object]] = {
    "identity": lambda: cj.identity(),
    "topk(0.01)": lambda: cj.topk(0.01),
    "topk(0.001)": lambda: cj.topk(0.001),
    "randomk(0.01)": lambda: cj.randomk(0.01, key=0),
    "dgc(0.001)": lambda: cj.dgc(0.001),
    "dgc(0.001, exact top-k)": lambda: cj.dgc(0.001, sample_ratio=None),
    "powersgd(rank=2)": lambda: cj.powersgd(rank=2),
    "powersgd(rank=4)": lambda: cj.powersgd(rank=4),
    "onebit": lambda: cj.onebit(),
    "twobit(0.5)": lambda: cj.twobit(0.5),
    "terngrad": lambda: cj.terngrad(key=0),
    "qsgd(256)": lambda: cj.qsgd(256, key=0),
    "signsgd": lambda: cj.signsgd(),
    "cast(float16)": lambda: cj.cast(jnp.float16),
    "cast(bfloat16)": lambda: cj.cast(jnp.bfloat16),
}

#: extra sections: name -> function(args) -> list of row dicts (with "name" and "ms_median").
SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {}


def selection_section(args: argparse.Namespace, size: int = 25_000_000, ratio: float = 0.001) -> list[dict]:
    """Top-k selection on one large gradient: exact ``lax.top_k`` vs DGC's sampled threshold, beside the floor.

    The gradient is a standard normal vector of ``size`` float32 entries
    (``size // 64`` with ``--small``); ``k = ratio * size``.  Both selections
    return the same ``k`` indices here (checked).
    """
    from compjax.codecs import layer_k, topk_select
    from compjax.codecs.threshold import sampled_topk

    size = size // 64 if args.small else size
    k = layer_k(size, ratio)
    x = jnp.asarray(np.random.default_rng(1).standard_normal(size, np.float32))
    e = x * 0.5
    key = jax.random.PRNGKey(0)
    floor = jax.jit(lambda g, e: g + e)
    exact = jax.jit(lambda x: topk_select(x, k)[0])
    sampled = jax.jit(lambda x, key: sampled_topk(x, k, 0.01, key)[0])
    same = set(np.asarray(exact(x)).tolist()) == set(np.asarray(sampled(x, key)).tolist())
    f_med, f_min = time_fn(floor, x, e, repeats=args.repeats)
    rows = [{"name": f"elementwise floor (g + e), {size:,} entries", "ms_median": f_med, "ms_min": f_min,
             "x_floor": 1.0}]
    for name, fn, fargs in [(f"exact jax.lax.top_k, k = {k:,}", exact, (x,)),
                            (f"sampled threshold (sample 1%), k = {k:,}", sampled, (x, key))]:
        med, mn = time_fn(fn, *fargs, repeats=args.repeats)
        rows.append({"name": name, "ms_median": med, "ms_min": mn, "x_floor": med / f_med})
    speedup = rows[1]["ms_median"] / rows[2]["ms_median"]
    rows[2]["note"] = f"{speedup:.1f}x faster than exact (medians); same indices as exact: {same}"
    rows[2]["speedup_vs_exact"] = speedup
    return rows


SECTIONS["top-k selection (25M entries at ratio 0.001)"] = selection_section


def draw_section(args: argparse.Namespace) -> list[dict]:
    """What TernGrad's and QSGD's one uniform draw per parameter costs alone, beside the floor.

    ``jax.random.uniform`` (threefry, the default PRNG) over as many float32
    values as the tree has parameters -- the draw :func:`compjax.compressors.keys.step_uniforms`
    makes every step -- summed so that the draw is not optimised away.
    """
    tree = make_tree(args.small)
    n = sum(int(x.size) for x in jax.tree.leaves(tree))
    f_med, f_min = floor_ms(tree, args.repeats)
    draw = jax.jit(lambda key: jnp.sum(jax.random.uniform(key, (n,), jnp.float32)))
    med, mn = time_fn(draw, jax.random.PRNGKey(0), repeats=args.repeats)
    return [{"name": "elementwise floor (g + e)", "ms_median": f_med, "ms_min": f_min, "x_floor": 1.0},
            {"name": f"jax.random.uniform, {n:,} float32 (threefry)", "ms_median": med, "ms_min": mn,
             "x_floor": med / f_med}]


SECTIONS["one uniform draw per parameter"] = draw_section


def without_draw_section(args: argparse.Namespace) -> list[dict]:
    """TernGrad's and QSGD's update with the uniform draw replaced by a constant 0.5: the rest of their cost.

    The compressors' own ``update`` is traced with their module's
    ``step_uniforms`` patched (benchmark only), so what is timed is clipping,
    scaling, encoding, packing, unpacking and decoding -- everything but ``jax.random``.
    """
    import importlib
    from unittest import mock

    # The modules, not the factories of the same name that compjax.compressors re-exports.
    qsgd_module = importlib.import_module("compjax.compressors.qsgd")
    terngrad_module = importlib.import_module("compjax.compressors.terngrad")

    tree = make_tree(args.small)
    f_med, f_min = floor_ms(tree, args.repeats)
    rows = [{"name": "elementwise floor (g + e)", "ms_median": f_med, "ms_min": f_min, "x_floor": 1.0}]

    def constant(key, count, axis_name, leaves):
        return [jnp.full((x.size,), 0.5, jnp.float32) for x in leaves]

    for name, module, make in [("terngrad", terngrad_module, lambda: cj.terngrad(key=0)),
                               ("qsgd(256)", qsgd_module, lambda: cj.qsgd(256, key=0))]:
        with mock.patch.object(module, "step_uniforms", constant):
            tx = make()
            update = jax.jit(tx.update)
            med, mn = time_fn(update, tree, tx.init(tree), repeats=args.repeats)
        rows.append({"name": f"{name}, uniforms replaced by 0.5", "ms_median": med, "ms_min": mn,
                     "x_floor": med / f_med})
    return rows


SECTIONS["TernGrad and QSGD without the draw"] = without_draw_section


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


def make_tree(small: bool, seed: int = 0) -> dict[str, jnp.ndarray]:
    rng = np.random.default_rng(seed)  # NumPy: one jax.random compile per leaf shape would take a minute
    return {k: jnp.asarray(rng.standard_normal(s, np.float32)) for k, s in resnet18_shapes(small=small).items()}


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


def run(args: argparse.Namespace) -> dict:
    tree = make_tree(args.small)
    n_params = sum(int(x.size) for x in jax.tree.leaves(tree))
    floor_med, floor_min = floor_ms(tree, args.repeats)
    names = list(COMPRESSORS) if not args.only else [n for n in COMPRESSORS if n in args.only.split(",")]
    rows = [{"name": "elementwise floor (g + e)", "ms_median": floor_med, "ms_min": floor_min, "x_floor": 1.0,
             "payload_bytes": None, "ratio": None}]
    dense = 4 * n_params
    for name in names:
        tx = COMPRESSORS[name]()
        state = tx.init(tree)
        update = jax.jit(tx.update)
        _, new_state = jax.block_until_ready(update(tree, state))
        med, mn = time_fn(update, tree, state, repeats=args.repeats)
        nbytes = int(cj.payload_bytes(new_state))
        rows.append({"name": name, "ms_median": med, "ms_min": mn, "x_floor": med / floor_med,
                     "payload_bytes": nbytes, "ratio": dense / nbytes if nbytes else None})
        print(f"  {name}: {med:.1f} ms", file=sys.stderr, flush=True)
    sections = {}
    for sname, fn in SECTIONS.items():
        if not args.only or sname in args.only.split(","):
            sections[sname] = fn(args)
    return {
        "command": "python -m experiments.benchmarks.compressors " + " ".join(args.argv),
        "machine": {"jax": jax.__version__, "backend": jax.default_backend(),
                    "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
                    "platform": platform.platform()},
        "tree": {"name": "ResNet-18 (small)" if args.small else "ResNet-18", "params": n_params,
                 "leaves": len(jax.tree.leaves(tree))},
        "repeats": args.repeats,
        "rows": rows,
        "sections": sections,
    }


def markdown(result: dict) -> str:
    m, t = result["machine"], result["tree"]
    lines = [
        f"Command: `{result['command']}`  ",
        f"Tree: {t['name']}-shaped gradients, {t['params']:,} float32 params in {t['leaves']} leaves; one worker.  ",
        (f"Machine: jax {m['jax']} on {m['backend']} ({m['device']}), {m['cpu_count']} CPUs; "
        f"median of {result['repeats']} runs after compilation."),
        "",
        "| update | median ms | min ms | × floor | payload bytes | ratio vs identity |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        nb = f"{r['payload_bytes']:,}" if r["payload_bytes"] is not None else "—"
        ratio = f"{r['ratio']:.1f}×" if r["ratio"] else "—"
        lines.append(f"| {r['name']} | {r['ms_median']:.2f} | {r['ms_min']:.2f} | {r['x_floor']:.1f} | {nb} | {ratio} |")
    for sname, rows in result["sections"].items():
        lines += ["", f"**{sname}**", "", "| what | median ms | min ms | × floor | note |", "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['name']} | {r['ms_median']:.2f} | {r['ms_min']:.2f} | {r['x_floor']:.1f} | "
                         f"{r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--only", default="", help="comma-separated names of compressors/sections")
    p.add_argument("--small", action="store_true", help="a tree 16x narrower (for tests)")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--readme", type=Path, default=None, help="also replace the results:benchmark block of this file")
    args = p.parse_args(argv)
    args.argv = argv
    result = run(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "compressors.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (args.out_dir / "compressors.md").write_text(md)
    if args.readme:
        from experiments.results_table import update_readme

        update_readme(args.readme, md, "benchmark")
    print(md, end="")
    return result


if __name__ == "__main__":
    main()
