"""compjax beside PyTorch on the same CPU: PowerSGD, top-k with error feedback, sign / 1-bit packing.

    pip install -e ".[bench]"       # torch==2.13.0 (CPU wheel); never a core dependency
    python -m experiments.benchmarks.torch_compare [--repeats 7] [--small]
    python -m experiments.benchmarks.torch_compare --repeats 5 --publish   # the committed table

Identical tensors (the ResNet-18-shaped tree of :mod:`experiments.benchmarks.compressors`,
11.7M float32 parameters, one worker), the same machine, the same number of
threads (``torch.set_num_threads(os.cpu_count())``; XLA:CPU uses every core),
median of ``--repeats`` runs after a warm-up; the compjax side runs first, in a
child process without torch, with XLA:CPU's concurrency-optimized scheduler
off (as the tests and the main job run; with it on, PowerSGD's update hung in
our runs).  Each row times one step of the
same math on both sides and gives the ratio compjax / torch (below 1: compjax
is faster):

* **PowerSGD** (ranks 1, 2, 4): the math of
  ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` -- error
  feedback, warm start, ``P = M Q``, orthogonalize ``P`` (the hook's own
  ``_orthogonalize``), ``Q = Mᵀ P``, ``M ≈ P Qᵀ``, vectors uncompressed -- per
  tensor (the hook's default) and batched over same-shape tensors
  (``batch_tensors_with_same_shape=True``), vs ``cj.powersgd(rank)``.  The
  torch matrices are compjax's ``(out, rest)`` views of the same leaves, and
  both sides compress the same ones (``min_compression_rate=2``, both defaults).
* **top-k with error feedback** (ratios 0.01, 0.001): ``p = g + e``,
  ``torch.topk(|p|, k)`` per tensor, dense output by ``scatter``, ``e = p`` zeroed
  at the sent entries, vs ``cj.topk(ratio)``.
* **sign / 1-bit**: EF-signSGD (scale ``‖p‖₁/d``) and 1-bit SGD (per-column
  means of each sign), signs packed 8 per byte with torch bit operations and
  unpacked, vs ``cj.signsgd()`` / ``cj.onebit()`` (32 signs per uint32 word).

No collectives on either side (one worker): the compute cost only.  Prints one
line and exits 0 when torch is not installed.  Writes ``torch_compare.json``
(with the command and provenance) and ``torch_compare.md`` to
``runs/benchmarks`` (git-ignored), with ``--publish`` to
``experiments/results/benchmarks`` (the committed results), or to ``--out-dir``.

References:
  Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization", NeurIPS 2019; PyTorch
  ``powerSGD_hook``.
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
from pathlib import Path

import numpy as np

from experiments import config_cli, records

HERE = Path(__file__).resolve().parent
PROG = "python -m experiments.benchmarks.torch_compare"


def _median_ms(fn, repeats: int, sync=lambda x: x) -> float:
    sync(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sync(fn())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


# --- torch side ------------------------------------------------------------------------------


def _torch_orthogonalize(torch):
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

        def ortho(m):
            _orthogonalize(m, 0)  # in place
            return m

        return ortho
    except Exception:  # noqa: BLE001 -- a build without torch.distributed: the hook's Gram-Schmidt, written out

        def gram_schmidt(m):
            for i in range(m.shape[-1]):
                col = m[..., i : i + 1]
                col /= torch.linalg.norm(col, dim=-2, keepdim=True)
                if i + 1 < m.shape[-1]:
                    rest = m[..., i + 1 :]
                    rest -= torch.sum(col * rest, dim=-2, keepdim=True) * col
            return m

        return gram_schmidt


def torch_powersgd(torch, mats, vecs, rank: int, batched: bool):
    """One step of powerSGD_hook's math (world size 1) on ``mats`` (2-D) and ``vecs``; returns ``step()``."""
    ortho = _torch_orthogonalize(torch)
    gen = torch.Generator().manual_seed(0)
    if batched:
        groups: dict = {}
        for m in mats:
            groups.setdefault(tuple(m.shape), []).append(m)
        blocks = [torch.stack(ms) for ms in groups.values()]
    else:
        blocks = [m[None] for m in mats]
    ranks = [min(rank, *b.shape[1:]) for b in blocks]
    qs = [ortho(torch.randn(b.shape[0], b.shape[2], r, generator=gen)) for b, r in zip(blocks, ranks)]
    errors = [torch.zeros_like(b) for b in blocks]

    def step():
        outs = []
        for j, (b, r) in enumerate(zip(blocks, ranks)):
            m = b + errors[j]  # error feedback
            p = torch.bmm(m, qs[j])
            p = ortho(p)
            q = torch.bmm(m.transpose(1, 2), p)
            qs[j] = q  # warm start (world size 1: the all-reduced Q is this Q)
            approx = torch.bmm(p, q.transpose(1, 2))
            errors[j] = m - approx
            outs.append(approx)
        outs += [v.clone() for v in vecs]  # uncompressed tensors: all-reduced (a copy on one worker)
        return outs

    return step


def torch_topk(torch, tensors, ratio: float):
    errors = [torch.zeros_like(t) for t in tensors]
    ks = [max(1, math.ceil(ratio * t.numel() * (1 - 1e-12))) for t in tensors]

    def step():
        outs = []
        for j, (g, k) in enumerate(zip(tensors, ks)):
            p = (g + errors[j]).reshape(-1)
            idx = torch.topk(p.abs(), k, sorted=False).indices
            vals = p[idx]
            outs.append(torch.zeros_like(p).scatter_(0, idx, vals).reshape(g.shape))
            p[idx] = 0
            errors[j] = p.reshape(g.shape)
        return outs

    return step


def _pack(torch, bits, weights):
    n = bits.numel()
    pad = (-n) % 8
    b = torch.nn.functional.pad(bits.to(torch.uint8), (0, pad)).view(-1, 8)
    return (b << weights).sum(dim=1, dtype=torch.uint8), n


def _unpack(torch, packed, n, weights):
    return ((packed[:, None] >> weights) & 1).reshape(-1)[:n].to(torch.bool)


def torch_sign(torch, tensors, onebit: bool):
    """EF-signSGD (``onebit=False``) or 1-bit SGD with per-column means, signs packed 8 per byte."""
    errors = [torch.zeros_like(t) for t in tensors]
    weights = torch.arange(8, dtype=torch.uint8)

    def step():
        outs = []
        for j, g in enumerate(tensors):
            p = g + errors[j]
            cols = p.reshape(-1, p.shape[-1] if p.ndim >= 2 else 1)
            pos = cols >= 0
            packed, n = _pack(torch, pos.reshape(-1), weights)  # the wire: packed signs (+ scales)
            if onebit:
                n_pos = pos.sum(0)
                total, absolute = cols.sum(0), cols.abs().sum(0)
                hi = torch.where(n_pos > 0, (total + absolute) / 2 / n_pos.clamp(min=1), 0.0)
                lo = torch.where(n_pos < cols.shape[0], (total - absolute) / 2 / (cols.shape[0] - n_pos).clamp(min=1), 0.0)
                bits = _unpack(torch, packed, n, weights).reshape(cols.shape)
                dec = torch.where(bits, hi, lo).reshape(p.shape)
            else:
                scale = p.abs().mean()
                dec = torch.where(_unpack(torch, packed, n, weights), scale, -scale).reshape(p.shape)
            errors[j] = p - dec
            outs.append(dec)
        return outs

    return step


# --- the comparison --------------------------------------------------------------------------


def numpy_tree(small: bool) -> dict[str, np.ndarray]:
    """The benchmark tree as NumPy arrays: the values of :func:`experiments.benchmarks.compressors.make_tree`."""
    from experiments.benchmarks.compressors import tree_shapes

    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s, np.float32) for k, s in tree_shapes(small).items()}


def compjax_times(args: argparse.Namespace) -> dict:
    """The compjax side (run in its own process, without torch): median ms per row key, and the device."""
    import jax

    import compjax as cj
    from experiments.benchmarks.compressors import device_info

    tree = {k: jax.numpy.asarray(v) for k, v in numpy_tree(args.small).items()}

    def cj_ms(tx):
        update = jax.jit(tx.update)
        state = tx.init(tree)
        return _median_ms(lambda: update(tree, state), args.repeats, jax.block_until_ready)

    times = {f"powersgd{rank}": cj_ms(cj.powersgd(rank=rank)) for rank in (1, 2, 4)}
    times |= {f"topk{ratio}": cj_ms(cj.topk(ratio)) for ratio in (0.01, 0.001)}
    times |= {"signsgd": cj_ms(cj.signsgd()), "onebit": cj_ms(cj.onebit())}
    # provenance here, in the process that runs JAX (the torch process never starts XLA); run() sets its command
    return {"times": times, "jax": jax.__version__, **device_info(), "provenance": records.provenance("")}


def run(args: argparse.Namespace, torch) -> dict:
    import subprocess
    import tempfile

    threads = os.cpu_count() or 1
    # compjax in a child process (XLA's threads and torch's never share a process), torch here; same machine,
    # same inputs, one at a time.
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compjax.json"
        cmd = [sys.executable, "-m", "experiments.benchmarks.torch_compare", "--side", "compjax", "--side-out",
               str(out), "--repeats", str(args.repeats)] + (["--small"] if args.small else [])
        env = dict(os.environ)
        # XLA:CPU's concurrency-optimized scheduler hung (0% CPU) on PowerSGD's update here; off, as in the tests.
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()
        subprocess.run(cmd, check=True, cwd=HERE.parent.parent, env=env)
        side = json.loads(out.read_text())
    cj_times = side["times"]
    torch.set_num_threads(threads)
    tree = numpy_tree(args.small)
    t_flat = [torch.from_numpy(v.copy()) for v in tree.values()]  # flax layout, as compjax sees them
    # compjax's (out, rest) view of a leaf (..., out): x.reshape(rest, out).T
    def mats_and_rest(rank):
        """The matrices cj.powersgd(rank) compresses (default min_compression_rate), and the tensors sent dense."""
        from compjax.codecs.lowrank import use_lowrank

        low = [v.ndim >= 2 and use_lowrank(v.shape, rank, 2.0) for v in tree.values()]
        mats = [torch.from_numpy(np.ascontiguousarray(v.reshape(-1, v.shape[-1]).T))
                for v, lo in zip(tree.values(), low) if lo]
        return mats, [torch.from_numpy(v.copy()) for v, lo in zip(tree.values(), low) if not lo]

    rows = []

    def add(what, cj_name, c_ms, t_name, t_ms):
        rows.append({"what": what, "compjax": cj_name, "compjax_ms": c_ms, "torch": t_name, "torch_ms": t_ms,
                     "ratio": c_ms / t_ms})
        print(f"  {what}: compjax {c_ms:.1f} ms, torch {t_ms:.1f} ms, ratio {c_ms / t_ms:.2f}", file=sys.stderr,
              flush=True)

    for rank in (1, 2, 4):
        for batched in (False, True):
            t = _median_ms(torch_powersgd(torch, *mats_and_rest(rank), rank, batched), args.repeats)
            add(f"PowerSGD rank {rank}, torch {'batched same-shape' if batched else 'per tensor'}",
                f"cj.powersgd(rank={rank})", cj_times[f"powersgd{rank}"],
                "powerSGD_hook math" + (" (batched)" if batched else ""), t)
    for ratio in (0.01, 0.001):
        add(f"top-k {ratio} with error feedback", f"cj.topk({ratio})", cj_times[f"topk{ratio}"],
            "torch.topk + scatter", _median_ms(torch_topk(torch, t_flat, ratio), args.repeats))
    add("EF-signSGD, packed signs", "cj.signsgd()", cj_times["signsgd"], "sign + 8 bits/byte packing",
        _median_ms(torch_sign(torch, t_flat, onebit=False), args.repeats))
    add("1-bit SGD, packed signs", "cj.onebit()", cj_times["onebit"], "column means + 8 bits/byte packing",
        _median_ms(torch_sign(torch, t_flat, onebit=True), args.repeats))
    return {
        "command": shlex.join([*PROG.split(), *args.argv]),
        "machine": {"jax": side["jax"], "torch": torch.__version__, "backend": side["backend"],
                    "device": side["device"], "threads": threads, "cpu_count": os.cpu_count(),
                    "platform": platform.platform(), "processes": "compjax and torch in separate processes"},
        "tree": {"params": sum(int(v.size) for v in tree.values()), "leaves": len(tree)},
        "repeats": args.repeats,
        "rows": rows,
        "provenance": side["provenance"] | {"command": shlex.join([*PROG.split(), *args.argv])},
    }


def markdown(result: dict) -> str:
    m, load = result["machine"], result["loadavg"]
    lines = [
        f"Command: `{result['command']}`  ",
        (f"Tree: ResNet-18-shaped, {result['tree']['params']:,} float32 params in {result['tree']['leaves']} "
         "leaves; one worker, no collectives.  "),
        (f"Machine: jax {m['jax']} ({m['backend']}, {m['device']}), torch {m['torch']} (CPU), {m['threads']} threads "
         f"each; median of {result['repeats']} runs after a warm-up.  "),
        (f"Load average before {', '.join(f'{x:.2f}' for x in load['before'])}, after "
         f"{', '.join(f'{x:.2f}' for x in load['after'])}."),
        "",
        "| what | compjax | ms | torch | ms | compjax / torch |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['what']} | {r['compjax']} | {r['compjax_ms']:.1f} | {r['torch']} | {r['torch_ms']:.1f} | "
                     f"{r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = config_cli.OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--small", action="store_true", help="the benchmark's small tree: 11 narrow leaves (for tests)")
    records.add_output_arguments(p, "benchmarks")
    p.add_argument("--side", choices=["compjax"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--side-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    if args.side == "compjax":  # the child process of run()
        args.side_out.write_text(json.dumps(compjax_times(args)))
        return None
    try:
        import torch
    except ImportError:
        print("torch is not installed: skipping the PyTorch comparison (pip install -e '.[bench]')")
        return None
    out_dir = records.output_dir(args, "benchmarks")
    load_before = os.getloadavg()
    result = run(args, torch)
    result["loadavg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "torch_compare.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out_dir / "torch_compare.md").write_text(md)
    print(md, end="")
    print(f"wrote {out_dir}/torch_compare.{{json,md}}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
