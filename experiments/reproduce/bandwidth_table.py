"""Recompute the seed's bandwidth table: what each compressor would save ResNet-18, ResNet-50 and Swin-L on 1 and 10 GbE.

    python -m experiments.reproduce.bandwidth_table                 # full models (CPU, about a minute)
    python -m experiments.reproduce.bandwidth_table --audit         # also compile every program and check the bytes (slow)
    python -m experiments.reproduce.bandwidth_table --small         # tiny models (tests)
    python -m experiments.reproduce.bandwidth_table --publish       # the committed table

The models, their iteration times, the networks and the worker counts are
ml_collections config ``experiments/configs/bandwidth_table.py`` (``--config
FILE`` names another; ``--config.KEY=VALUE`` overrides a key, e.g.
``--config.workers=8,16``).

Inputs:

* **Gradients shaped like the models**: ResNet-18, ResNet-50 (He et al. 2016)
  and Swin-L (Liu et al. 2021), Flax NNX definitions in
  :mod:`experiments.imagenet_models`, built under ``nnx.eval_shape`` (no weights
  are allocated); their ``nnx.Param`` leaves are the float32 gradients.
* **Compute time per step**: the seed's iteration times on an RTX 2080 Ti at
  batch 32 -- 137, 330 and 940 ms.
* **Bytes per step**: each compressor's ``update`` (``skip_nonfinite=False``:
  pure compression, no non-finite vote) is traced under ``jax.shard_map`` over
  an abstract 8-worker mesh with ``jax.ShapeDtypeStruct`` gradients (nothing is
  allocated or run), and the collectives of the traced program are read with
  their operand shapes (:func:`trace_collectives`).  compjax's per-worker bytes
  do not depend on the number of workers, so one trace serves 8 and 64.
  ``--audit`` also compiles each program and checks that
  :func:`compjax.audit_collectives` finds the same bytes per collective kind
  (minutes per program for Swin-L); the tests check the traced bytes against
  ``cj.payload_bytes`` after a real step on small shapes.
* **Network model**: :mod:`compjax.netmodel` (ring all-reduce ``2(n-1)/n``
  bytes, ring all-gather ``(n-1)`` x payload, ``Network.ethernet_1g`` and
  ``Network.ethernet_10g`` with their per-message latencies).

Outputs ``bandwidth_table.md`` (tables), ``bandwidth_table.json`` (every number,
the command, the full config and provenance) and ``bandwidth_table.png``
(modelled step times) in ``runs/reproduce`` (git-ignored), with ``--publish``
in ``experiments/results/reproduce`` (the committed table), or in ``--out-dir``.

Settings: DGC with ``warmup_steps=0`` (the final 99.9% sparsity; its warm-up
stages would put one exchange per stage into the program) and its default
sampled threshold; PowerSGD with ``start_step=0``; QSGD with 256 levels
(10-bit codes); TernGrad, 1-bit SGD and MXNet 2-bit at their defaults (the
threshold and clipping do not change the bytes).  ``cast bf16`` travels as an
all-gather of the bf16 bits (compjax avoids XLA:CPU's widening of bf16
all-reduces, see :func:`compjax.cast`), so it pays ``(n-1)`` x its payload and
is slower than the dense all-reduce it halves; ``cast fp16`` is the 16-bit
all-reduce.
"""

from __future__ import annotations

from experiments.cpu_devices import force_cpu_devices

force_cpu_devices(8)  # --audit compiles on 8 CPU devices when there is no accelerator (tracing needs none)

import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import collectives as cj_collectives
from compjax import netmodel
from compjax.accounting import Collective
from experiments import config_cli, imagenet_models, records
from experiments.reproduce import common

STEM = "bandwidth_table"
PROG = "python -m experiments.reproduce.bandwidth_table"
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / f"{STEM}.py"
AXIS = "data"

#: name -> factory ``(axis_name) -> optax transformation``; pure compression (no non-finite vote).
COMPRESSORS = {
    "identity": lambda ax: cj.identity(axis_name=ax, skip_nonfinite=False),
    "cast bf16": lambda ax: cj.cast(jnp.bfloat16, axis_name=ax, skip_nonfinite=False),
    "cast fp16": lambda ax: cj.cast(jnp.float16, axis_name=ax, skip_nonfinite=False),
    "topk 1%": lambda ax: cj.topk(0.01, axis_name=ax, skip_nonfinite=False),
    "dgc 0.1%": lambda ax: cj.dgc(0.001, warmup_steps=0, axis_name=ax, skip_nonfinite=False),
    "powersgd r2": lambda ax: cj.powersgd(2, start_step=0, axis_name=ax, skip_nonfinite=False),
    "powersgd r4": lambda ax: cj.powersgd(4, start_step=0, axis_name=ax, skip_nonfinite=False),
    "onebit": lambda ax: cj.onebit(axis_name=ax, skip_nonfinite=False),
    "twobit": lambda ax: cj.twobit(axis_name=ax, skip_nonfinite=False),
    "terngrad": lambda ax: cj.terngrad(key=0, axis_name=ax, skip_nonfinite=False),
    "qsgd 256": lambda ax: cj.qsgd(256, key=0, axis_name=ax, skip_nonfinite=False),
}
BASELINE = "identity"
#: the keys of each model of the config (see experiments/configs/bandwidth_table.py).
MODEL_KEYS = ("label", "definition", "small", "compute_s", "seed_parameters")
#: short names of network presets in the tables (others appear under their preset name).
_SHORT = {"ethernet_1g": "1 GbE", "ethernet_10g": "10 GbE"}


def networks(config) -> tuple[netmodel.Network, ...]:
    """The config's :class:`compjax.netmodel.Network` presets."""
    return tuple(netmodel.Network.presets()[name] for name in config.networks)


def check(config) -> None:
    """One-line ``SystemExit`` for a config the table cannot be built from."""
    presets = netmodel.Network.presets()

    def fail(key, what):
        raise SystemExit(f"{PROG}: --config.{key}={config_cli.get(config, key)!r}: {what}")

    def count(n, least):
        return isinstance(n, int) and not isinstance(n, bool) and n >= least

    if not config.networks or any(n not in presets for n in config.networks):
        fail("networks", f"each must be one of {', '.join(presets)}")
    if not config.workers or not all(count(n, 2) for n in config.workers):
        fail("workers", "each must be an integer >= 2")
    if not count(config.trace_workers, 1):
        fail("trace_workers", "must be >= 1")
    for m in config.models:
        if not isinstance(m, dict) or set(MODEL_KEYS) - set(m):
            raise SystemExit(f"{PROG}: --config.models: each model is a dict with the keys {', '.join(MODEL_KEYS)}")
        for key in ("definition", "small"):
            if m[key] not in imagenet_models.MODELS:
                raise SystemExit(f"{PROG}: --config.models: {m['label']!r}: {key} {m[key]!r} is none of "
                                 f"{', '.join(sorted(imagenet_models.MODELS))}")


# --------------------------------------------------------------------------- bytes from the traced program

#: jaxpr primitives of collectives -> HLO opcode (the ``op`` of :class:`compjax.Collective`).
_COLLECTIVE_PRIMITIVES = {
    "psum": "all-reduce", "psum_invariant": "all-reduce", "pmax": "all-reduce", "pmin": "all-reduce",
    "all_gather": "all-gather", "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter", "all_to_all": "all-to-all", "ppermute": "collective-permute",
}
#: primitives whose sub-programs run conditionally or repeatedly: a collective there has no single count.
_BRANCHING = {"cond", "while", "scan"}


def _axes(params) -> tuple:
    for key in ("axes", "axis_name"):
        if key in params:
            v = params[key]
            return tuple(v) if isinstance(v, (tuple, list)) else (v,)
    return ()


def _operand_bytes(op: str, aval) -> int:
    if op == "all-reduce":
        return cj_collectives.reduce_bytes(aval)  # compjax's count (bf16 widened on XLA:CPU)
    return int(aval.size) * jnp.dtype(aval.dtype).itemsize


def _walk(jaxpr, out: list, inside: str | None) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _COLLECTIVE_PRIMITIVES and AXIS in _axes(eqn.params):
            if inside is not None:
                raise ValueError(
                    f"a {name} over {AXIS!r} sits inside a {inside}: how often it runs depends on runtime values; "
                    "use settings with one path (e.g. DGC warmup_steps=0, PowerSGD start_step=0)"
                )
            op = _COLLECTIVE_PRIMITIVES[name]
            avals = [v.aval for v in eqn.invars]
            operands = tuple((jnp.dtype(a.dtype).name, tuple(a.shape)) for a in avals)
            out.append(Collective(op, operands, sum(_operand_bytes(op, a) for a in avals), f"{name}.{len(out)}"))
        for sub in jex.jaxprs_in_params(eqn.params):
            _walk(sub, out, name if name in _BRANCHING else inside)


def _program(tx, shapes, mesh):
    """``jit(shard_map(update))`` over worker-stacked gradients and state, and its abstract arguments."""
    n = mesh.shape[AXIS]
    state = jax.eval_shape(tx.init, shapes)

    def body(g, s):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        u, s = tx.update(g, s)
        return jax.tree.map(lambda x: x[None], (u, s))

    def stacked(tree):
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype, sharding=NamedSharding(mesh, P(AXIS))), tree)

    spec = P(AXIS)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
    return fn, (stacked(shapes), stacked(state))


def trace_collectives(tx, shapes, workers: int = 8) -> list[Collective]:
    """The collectives one step of ``tx.update`` issues on gradients shaped like ``shapes`` (traced, not run).

    ``tx`` must use ``axis_name="data"``.  The update runs under ``jax.shard_map``
    over an abstract ``workers``-device mesh (no devices needed, nothing
    allocated) and every collective over ``"data"`` in the traced program is
    returned as a :class:`compjax.Collective` (op, operand dtypes and shapes,
    operand bytes per worker), in program order.

    Raises:
      ValueError: a collective inside ``lax.cond``/``while_loop``/``scan`` (its
        count per step is not static).
    """
    fn, args = _program(tx, shapes, AbstractMesh((workers,), (AXIS,)))
    out: list[Collective] = []
    _walk(fn.trace(*args).jaxpr.jaxpr, out, None)
    return out


def audit(tx, shapes) -> list[Collective]:
    """:func:`compjax.audit_collectives` of the same program, compiled on a mesh of up to 8 real devices (>= 2)."""
    from compjax import parallel

    n = min(8, len(jax.devices()))
    if n < 2:
        raise ValueError("--audit needs at least 2 devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    fn, args = _program(tx, shapes, parallel.make_mesh(n, AXIS))
    return cj.audit_collectives(fn, *args)


def _by_kind(ops) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in ops:
        out[c.op] = out.get(c.op, 0) + int(c.bytes)
    return out


@functools.cache
def step_collectives(compressor: str, model: str, check_audit: bool = False,
                     trace_workers: int = 8) -> tuple[Collective, ...]:
    """Traced collectives of ``compressor`` on ``model``'s gradients (cached per pair)."""
    tx = COMPRESSORS[compressor](AXIS)
    shapes = imagenet_models.param_shapes(model)
    ops = trace_collectives(tx, shapes, trace_workers)
    if check_audit:
        audited = audit(tx, shapes)
        if _by_kind(audited) != _by_kind(ops):
            raise AssertionError(f"{compressor} on {model}: traced {_by_kind(ops)} != compiled {_by_kind(audited)}")
    return tuple(ops)


# --------------------------------------------------------------------------- the tables


def _finite(x):
    return x if isinstance(x, (int, str)) or math.isfinite(x) else None


def compute(config, small: bool = False, check_audit: bool = False) -> dict:
    """Every number of the table: models, the dense all-reduce's hiding bandwidths, compressor rows."""
    no_latency = netmodel.Network(1.0, 0.0, "no latency")
    nets, workers = networks(config), tuple(config.workers)
    models, dense, summary, rows = [], [], [], []
    for m in config.models:
        label, compute_s = m["label"], m["compute_s"]
        name = m["small"] if small else m["definition"]
        shapes = imagenet_models.param_shapes(name)
        params = imagenet_models.count_params(shapes)
        models.append({"model": label, "definition": name, "parameters": params, "leaves": len(jax.tree.leaves(shapes)),
                       "seed_parameters": None if small else m["seed_parameters"], "compute_s": compute_s})
        steps = {c: list(step_collectives(c, name, check_audit, config.trace_workers)) for c in COMPRESSORS}
        for n in workers:
            rec = {"model": label, "workers": n, "dense_bytes": sum(c.bytes for c in steps[BASELINE])}
            for net in (no_latency, *nets):
                p = netmodel.predict_step(steps[BASELINE], n, net, compute_s)
                rec[f"hiding_bandwidth[{net.name}]"] = _finite(p.hiding_bandwidth)
            dense.append(rec)
        base_bytes = sum(c.bytes for c in steps[BASELINE])
        for comp, ops in steps.items():
            nbytes = sum(c.bytes for c in ops)
            kinds = _by_kind(ops)
            summary.append({
                "model": label, "compressor": comp, "bytes": nbytes, "ratio": base_bytes / nbytes,
                "collectives": [[c.op, c.bytes] for c in ops], "bytes_by_kind": kinds,
                **{f"hiding_bandwidth[n={n}]": _finite(netmodel.predict_step(ops, n, no_latency, compute_s).hiding_bandwidth)
                   for n in workers},
            })
        for r in netmodel.compare(steps, workers, nets, compute_s, baseline=BASELINE):
            rows.append({"model": label, **{k: _finite(v) for k, v in r.items()}})
    return {"models": models, "dense": dense, "compressors": summary, "rows": rows}


def _network_names(res: dict) -> list[str]:
    return [n["name"] for n in res["meta"]["networks"]]


def _gbit(bps) -> str:
    return "∞" if bps is None else f"{bps * 8 / 1e9:.3g}"


def _kinds(ops) -> str:
    counts: dict[str, int] = {}
    for op, _ in ops:
        counts[op] = counts.get(op, 0) + 1
    short = {"all-reduce": "AR", "all-gather": "AG"}
    return " + ".join(f"{short.get(op, op)}×{k}" if k > 1 else short.get(op, op) for op, k in counts.items())


def _gathering(res: dict) -> dict[str, float]:
    """Compressors that all-gather, with their smallest ratio over the models."""
    out: dict[str, float] = {}
    for s in res["compressors"]:
        if "all-gather" in s["bytes_by_kind"]:
            out[s["compressor"]] = min(out.get(s["compressor"], math.inf), s["ratio"])
    return out


def _all_reduced(res: dict) -> list[str]:
    gathering = _gathering(res)
    return [c for c in COMPRESSORS if c not in gathering and c != BASELINE]


def _clears(res: dict) -> str:
    """Which all-gather compressors' ratios (smallest over the models) exceed n/2 at which n."""
    groups: dict[tuple, list[str]] = {}
    for c, ratio in _gathering(res).items():
        groups.setdefault(tuple(n for n in res["meta"]["workers"] if ratio > n / 2), []).append(f"{c} ({ratio:.3g}×)")
    parts = []
    for ns, names in sorted(groups.items(), key=lambda kv: -len(kv[0])):
        where = f"at {' and '.join(map(str, ns))} workers" if ns else "at neither"
        parts.append(f"{', '.join(names)}: above it {where}")
    return "Smallest ratio over the models: " + "; ".join(parts) + "."


def _slower(res: dict) -> list[str]:
    """Per network and n: the compressors slower than the baseline (no overlap), per model when they differ."""
    lines = []
    for net in _network_names(res):
        for n in res["meta"]["workers"]:
            per_model = {}
            for m in res["models"]:
                per_model[m["model"]] = [r["compressor"] for r in res["rows"] if r["model"] == m["model"]
                                         and r["network"] == net and r["workers"] == n and r["speedup"] < 1]
            lists = {", ".join(v) or "none" for v in per_model.values()}
            if len(lists) == 1:
                what = f"{lists.pop()} (every model)"
            else:
                what = "; ".join(f"{k}: {', '.join(v) or 'none'}" for k, v in per_model.items())
            lines.append(f"- {_SHORT.get(net, net)}, {n} workers: {what}.")
    return lines


def _notes(res: dict) -> list[str]:
    out = [
        ("AR: all-reduce, AG: all-gather. Per worker, a ring all-reduce of `b` bytes moves `2(n-1)/n · b` and a ring "
        "all-gather of a `b`-byte payload moves `(n-1) · b`, so on bandwidth an all-gather compressor beats the dense "
        "all-reduce only when its compression ratio exceeds `n/2`: "
        f"{' and '.join(f'{n // 2} at {n} workers' for n in res['meta']['workers'])}. "
        f"{_clears(res)} The all-reduced compressors ({', '.join(_all_reduced(res))}) keep their advantage at any n."),
        "",
        "Slower than the dense all-reduce (no overlap):",
        "",
        *_slower(res),
        "",
        ("The trace lists each collective the compressor issues; XLA may merge independent all-reduces "
         "(XLA:CPU merged PowerSGD's dense vectors with P in our audits), which saves one collective's latency "
         "(at most `2(n-1)` × 50 µs = 6.3 ms at 64 workers on 1 GbE) and no bytes."),
    ]
    if not res["meta"]["small"]:
        out += [
            "",
            ("Parameter counts: ResNet-18 agrees with the seed (11.69M). ResNet-50 here has 25,557,032 parameters, "
            "torchvision's `resnet50` count (He et al.'s bottleneck ResNet-50, 1000 classes, projection shortcuts "
            "where the shape changes); the seed's 24.46M matches no standard ResNet-50 we know. Swin-L has "
            "196,532,476, timm's `swin_large_patch4_window7_224` count and the paper's 197M (Liu et al. 2021, "
            "Table 1); the seed's 98.20M is about half of it. The models are not changed to match the seed."),
        ]
    return out


def markdown(res: dict) -> str:
    """The markdown report of :func:`compute`'s result."""
    meta = res["meta"]
    workers, nets = meta["workers"], _network_names(res)
    command = res.get("command", PROG + (" --small" if meta["small"] else ""))
    net_text = ", ".join(f"`Network.{n['name']}` = {n['bandwidth'] * 8 / 1e9:g} Gbit/s, {n['latency'] * 1e6:g} µs"
                         + (" per message" if i == 0 else "") for i, n in enumerate(meta["networks"]))
    out = [
        "# Bandwidth table: dense all-reduce vs gradient compressors on ImageNet models",
        "",
        (f"Regenerate: `{command}` "
        f"({meta['run_s']:.0f} s on {meta['backend']}, compjax {meta['compjax']}, JAX {meta['jax']})."),
        "",
        ("Compute times are the seed's iteration times (RTX 2080 Ti, batch 32). Bytes are what one worker puts into "
        "the step's collectives, traced from each compressor's `update` on gradients shaped like the model "
        "(`skip_nonfinite=False`); the ratio is the dense float32 all-reduce's bytes over them. Times come from "
        "`compjax.netmodel`: ring all-reduce (`2(n-1)` messages of `b/n`), ring all-gather (`n-1` messages of the "
        f"whole payload `b`), one collective after another; {net_text}. \"No overlap\" = compute + communication; "
        "\"overlap\" = max(compute, communication), communication perfectly hidden behind the backward pass."),
        "",
        "## Models",
        "",
        "| model | definition | parameters | leaves | the seed's count | fp32 gradient (MB) | iteration time (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in res["models"]:
        seed = "—" if m["seed_parameters"] is None else f"{m['seed_parameters'] / 1e6:.2f}M"
        out.append(f"| {m['model']} | `{m['definition']}` | {m['parameters']:,} ({m['parameters'] / 1e6:.2f}M) | "
                   f"{m['leaves']} | {seed} | {4 * m['parameters'] / 1e6:.1f} | {m['compute_s'] * 1e3:.0f} |")
    out += [
        "",
        "## The bandwidth a dense all-reduce needs to hide behind compute",
        "",
        ("Link bandwidth (Gbit/s) at which the ring all-reduce of the float32 gradient takes exactly the iteration "
        "time: below it, communication is the bottleneck even with perfect overlap."),
        "",
        "| model | workers | fp32 gradient (MB) | no latency | "
        + " | ".join(f"α = {n['latency'] * 1e6:g} µs ({_SHORT.get(n['name'], n['name'])})" for n in meta["networks"])
        + " |",
        "|---|---|---|---|" + "---|" * len(nets),
    ]
    for d in res["dense"]:
        out.append(f"| {d['model']} | {d['workers']} | {d['dense_bytes'] / 1e6:.1f} | "
                   f"{_gbit(d['hiding_bandwidth[no latency]'])} | "
                   + " | ".join(_gbit(d[f"hiding_bandwidth[{net}]"]) for net in nets) + " |")
    rows = {(r["model"], r["compressor"], r["network"], r["workers"]): r for r in res["rows"]}
    for m in res["models"]:
        label = m["model"]
        out += [
            "",
            f"## {label}: {m['parameters'] / 1e6:.2f}M parameters, {m['compute_s'] * 1e3:.0f} ms per iteration",
            "",
            ("Each network cell: modelled step time in ms, no overlap / perfect overlap, and the speedup over "
            "`identity` without overlap. \"Hides at\": the bandwidth (Gbit/s, no latency) at which the step's "
            "communication takes the iteration time."),
            "",
            f"| compressor | collectives | bytes/step/worker | ratio | hides at, n={' / '.join(map(str, workers))} "
            "(Gbit/s) | " + " | ".join(f"{_SHORT.get(net, net)}, n={n}" for net in nets for n in workers) + " |",
            "|---|---|---|---|---|" + "---|" * (len(nets) * len(workers)),
        ]
        for s in (s for s in res["compressors"] if s["model"] == label):
            cells = []
            for net in nets:
                for n in workers:
                    r = rows[(label, s["compressor"], net, n)]
                    cells.append(f"{r['no_overlap_s'] * 1e3:,.0f} / {r['overlap_s'] * 1e3:,.0f} ({r['speedup']:.2f}×)")
            hides = " / ".join(_gbit(s[f"hiding_bandwidth[n={n}]"]) for n in workers)
            out.append(f"| {s['compressor']} | {_kinds(s['collectives'])} | {s['bytes']:,} | {s['ratio']:.1f}× | "
                       f"{hides} | " + " | ".join(cells) + " |")
    out += ["", "## Reading the table", "", *_notes(res), ""]
    return "\n".join(out)


def plot(res: dict, path: Path) -> None:
    """Modelled step time (no overlap) per compressor, one panel per model (matplotlib, Agg backend)."""
    models = res["models"]
    comps = list(COMPRESSORS)
    configs = [(net, n) for net in _network_names(res) for n in res["meta"]["workers"]]
    rows = {(r["model"], r["compressor"], r["network"], r["workers"]): r for r in res["rows"]}
    width = 0.8 / len(configs)
    with common.figure(path, figsize=(12, 3.6 * len(models)), dpi=110, rect=(0, 0.03, 1, 1), nrows=len(models),
                       ncols=1, squeeze=False) as (fig, axes):
        for ax, m in zip(axes[:, 0], models):
            for j, (net, n) in enumerate(configs):
                ys = [rows[(m["model"], c, net, n)]["no_overlap_s"] * 1e3 for c in comps]
                xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(comps))]
                ax.bar(xs, ys, width, label=f"{_SHORT.get(net, net)}, {n} workers")
            ax.axhline(m["compute_s"] * 1e3, color="k", ls="--", lw=1, label="compute only")
            ax.set_yscale("log")
            ax.set_xticks(range(len(comps)), comps, rotation=20)
            ax.set_ylabel("step time, no overlap (ms)")
            ax.set_title(f"{m['model']} ({m['parameters'] / 1e6:.1f}M parameters, {m['compute_s'] * 1e3:.0f} ms "
                         "compute)")
            ax.grid(axis="y", which="both", alpha=0.3)
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, labels, ncol=len(labels), fontsize=9, loc="lower center")


def main(argv=None) -> dict:
    p = common.parser(PROG, __doc__, DEFAULT_CONFIG, "--config.workers=8,16")
    p.add_argument("--small", action="store_true", help="tiny models of the same families (tests)")
    p.add_argument("--audit", action="store_true",
                   help="also compile each program and check its collectives' bytes against the trace (slow)")
    head = common.parse(p, argv, DEFAULT_CONFIG)
    config, args, out_dir, command = head.config, head.args, head.out_dir, head.command
    check(config)
    t0 = time.perf_counter()
    res = compute(config, small=args.small, check_audit=args.audit)
    res["meta"] = {"small": args.small, "audited": args.audit, "run_s": time.perf_counter() - t0,
                   "backend": jax.default_backend(), "jax": jax.__version__, "compjax": cj.__version__,
                   "trace_workers": config.trace_workers, "workers": list(config.workers),
                   "networks": [n._asdict() for n in networks(config)]}
    res["command"], res["config"], res["provenance"] = command, config.to_dict(), records.provenance(command)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{STEM}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out_dir / f"{STEM}.md").write_text(markdown(res))
    plot(res, out_dir / f"{STEM}.png")
    print(markdown(res))
    print(f"wrote {out_dir / STEM}.{{md,json,png}}")
    return res


if __name__ == "__main__":
    main()
