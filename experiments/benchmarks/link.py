"""Measured on a real link: data-parallel processes over a rate-limited network, bytes counted by the kernel.

    python -m experiments.benchmarks.link                      # P = 2 and 4, 10 Mbit/s .. unlimited (root)
    python -m experiments.benchmarks.link --publish            # the committed experiments/results/benchmarks/link.*
    python -m experiments.benchmarks.link --quick              # 2 processes, dense CNN, 100 Mbit/s, a few steps
    python -m experiments.benchmarks.link --publish --report-only   # the tables again from the committed JSON

Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN): each process count runs in a
fresh network namespace (``unshare -n``) whose loopback is brought up with a
1500-byte MTU (Ethernet framing) and shaped by a token bucket
(``tc qdisc ... tbf rate R``).  Where a namespace or ``tc`` is not permitted the
script says so in one line and exits 0 without a table.

Inside the namespace, :mod:`experiments.launch` starts P processes of this
module (``--worker``), one CPU device each, joined by ``jax.distributed``; their
collectives go through gloo over TCP on that loopback.  Every row trains a
model with one method for a fixed number of steps:

* the main job's CNN (Fashion-MNIST shapes, 206,922 parameters, 32 images per
  worker, SGD with momentum) with ``identity`` (dense float32 all-reduce),
  ``cast(bfloat16)``, ``topk(0.01)``, ``dgc(0.001)``, ``powersgd(rank=2)`` and
  ``onebit``;
* the LM testbed's character transformer (``tiny``, 112,512 parameters,
  8 windows of 32 characters per worker, AdamW) with the same six, and with
  DiLoCo (H = 50, float32 outer gradients) and Streaming DiLoCo (H = 13,
  4 fragments, overlap 1, 4-bit E3M0 outer gradients): their windows are 50 and
  52 steps, so that every fragment synchronizes the same number of times in
  every window.

Synthetic batches (random images / characters of the right shapes): the bytes
and the time of a step do not depend on the values.  For each row and rate
the script measures the step time over the counted steps (median, min, max;
each step blocked on), and the bytes the kernel put on the link during them:
``tc -s qdisc show dev lo`` "Sent N bytes" (every packet of every process,
TCP/IP headers and acknowledgements included), minus an idle baseline (the
coordination service's heartbeats and the barriers around the window, measured
over an idle window at that rate).  The compute time alone is the same step
with the compressor's ``axis_name=None`` (no collective), measured while all
P processes compute at once (on a 2-core machine 4 processes share 2 cores),
right before each counted window, so that it sees the same load.

Beside each measurement: what compjax predicts.  Bytes:
:func:`compjax.netmodel.wire_bytes` of every audited collective
(:func:`compjax.audit_collectives` of the step; the payload bytes per worker
equal ``cj.payload_bytes``) at P processes, with gloo's algorithms and TCP/IP
framing (:data:`compjax.netmodel.Framing.gloo_tcp`).  Time:
:func:`compjax.netmodel.predict_step` at the rate with the measured compute
time and a per-message latency fitted on the unshaped rows of the same process
count (:func:`fit_latency`: the loopback adds no delay, the hosts do).  The
loopback is one shared medium: every process's packets go through
the same token bucket, so a ring collective whose P processes send at once
gets ``R / P`` each; the prediction uses ``Network(bandwidth=R / P)`` (the
ring's time is then ``total wire bytes / R``).

Step times are noisy where other jobs share the CPU: a step that waited for a
core during the window shows as communication.  The bytes do not depend on
the load.

Writes ``link.json`` (every measurement, the command, provenance), ``link.md``
and ``link.png`` (measured vs predicted step time per method and rate) to
``runs/benchmarks`` (git-ignored), with ``--publish`` to
``experiments/results/benchmarks``, or to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROG = "python -m experiments.benchmarks.link"
REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "runs" / "benchmarks"
PUBLISHED = REPO / "experiments" / "results" / "benchmarks"

#: Rates of the token bucket: label -> bits per second (None: no bucket, the loopback as it is).
RATES = {"10 Mbit/s": 10e6, "100 Mbit/s": 100e6, "1 Gbit/s": 1e9, "unlimited": None}
#: The link's MTU (bytes): Ethernet's, so TCP sends segments of at most 1448 payload bytes.
MTU = 1500
#: Methods per model; the DiLoCo rows only for the transformer (the LM testbed's methods).
COMPRESSORS = ("identity", "cast(bfloat16)", "topk(0.01)", "dgc(0.001)", "powersgd(rank=2)", "onebit")
DILOCO = {"diloco(H=50)": 50, "streaming diloco(H=13)": 13}
#: Steps of a DiLoCo row's window: a multiple of its H (and of 4 fragments' cycle for Streaming DiLoCo).
DILOCO_WINDOW = {"diloco(H=50)": 50, "streaming diloco(H=13)": 52}
MODELS = ("cnn", "lm")


# ----------------------------------------------------------------------------------------------------------------
# The kernel's counters.


def parse_tc_sent(text: str) -> tuple[int, int]:
    """``(bytes, packets)`` the root qdisc of ``tc -s qdisc show dev DEV`` says it sent.

    Raises:
      ValueError: no ``Sent N bytes M pkt`` line in ``text``.
    """
    m = re.search(r"^qdisc .*?\broot\b.*?\n\s*Sent (\d+) bytes (\d+) pkt", text, re.MULTILINE)
    if m is None:
        raise ValueError(f"no root qdisc 'Sent N bytes M pkt' line in tc output: {text[:200]!r}")
    return int(m.group(1)), int(m.group(2))


def parse_tc_dropped(text: str) -> int:
    """Packets the root qdisc dropped (``dropped N`` of its ``Sent`` line); 0 if absent."""
    m = re.search(r"^qdisc .*?\broot\b.*?\n\s*Sent \d+ bytes \d+ pkt \(dropped (\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else 0


def tc_counters(dev: str = "lo") -> dict:
    """The root qdisc's sent bytes, packets and drops on ``dev``."""
    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True).stdout
    sent, pkts = parse_tc_sent(out)
    return {"bytes": sent, "packets": pkts, "dropped": parse_tc_dropped(out)}


def set_rate(bits_per_s: float | None, dev: str = "lo") -> list[str]:
    """Shape ``dev`` with a token bucket of ``bits_per_s`` (None: a plain FIFO, which only counts); the command."""
    if bits_per_s is None:
        cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "10000"]
    else:
        # The bucket holds 1 ms at the rate (at least 4 KiB: a few full segments) and the queue up to 400 ms of
        # it.  A deeper bucket lets a short window's first bytes pass at the loopback's speed (64 KiB are 52 ms
        # at 10 Mbit/s, more than a compressed step's bytes).
        burst = max(4096, int(bits_per_s / 8 * 0.001))
        cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(bits_per_s)}bit",
               "burst", str(burst), "latency", "400ms"]
    subprocess.run(cmd, check=True, capture_output=True)
    return cmd


def permitted() -> str | None:
    """None if a network namespace with a shaped loopback can be made here; else why not (one line)."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    probe = (f"ip link set lo up && ip link set lo mtu {MTU} && "
             "tc qdisc add dev lo root tbf rate 100mbit burst 64kb latency 400ms && tc -s qdisc show dev lo")
    try:
        r = subprocess.run(["unshare", "-n", "sh", "-c", probe], capture_output=True, text=True, timeout=30,
                           check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare -n failed: {e}"
    if r.returncode != 0:
        return f"unshare -n / tc not permitted: {(r.stderr or r.stdout).strip().splitlines()[-1:] or r.returncode}"
    try:
        parse_tc_sent(r.stdout)
    except ValueError as e:
        return str(e)
    return None


# ----------------------------------------------------------------------------------------------------------------
# The worker: one of the P processes inside the namespace.


def make_tx(model: str, method: str, axis_name):
    """The optax transform of a row (``axis_name=None``: the same computation without collectives)."""
    import jax.numpy as jnp
    import optax

    import compjax as cj

    if method in DILOCO:
        inner = optax.adamw(1e-3)
        if method.startswith("diloco"):
            return cj.diloco(inner, sync_every=DILOCO[method], axis_name=axis_name)
        return cj.diloco(inner, sync_every=DILOCO[method], fragments=4, overlap=1, alpha=0.5,
                         outer=optax.sgd(1.0, momentum=0.9, nesterov=True),
                         compressor=cj.e3m0(error_feedback=False, skip_nonfinite=False, axis_name=axis_name),
                         axis_name=axis_name)
    comp = {
        "identity": lambda: cj.identity(axis_name=axis_name),
        "cast(bfloat16)": lambda: cj.cast(jnp.bfloat16, axis_name=axis_name),
        "topk(0.01)": lambda: cj.topk(0.01, axis_name=axis_name),
        "dgc(0.001)": lambda: cj.dgc(0.001, axis_name=axis_name),
        "powersgd(rank=2)": lambda: cj.powersgd(rank=2, axis_name=axis_name),
        "onebit": lambda: cj.onebit(axis_name=axis_name),
    }[method]()
    opt = optax.sgd(0.05, momentum=0.9) if model == "cnn" else optax.adamw(1e-3)
    if method == "dgc(0.001)" and model == "cnn":
        opt = optax.sgd(0.05)  # DGC applies the momentum itself
    return optax.chain(comp, opt)


def model_and_batch(model: str, workers: int, seed: int = 0):
    """``(params, loss_fn, global_batch)`` of a model, with a synthetic batch for ``workers`` workers."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if model == "cnn":
        from experiments import models

        params, _, loss_fn = models.build(seed)
        batch = (rng.normal(size=(32 * workers, 28, 28, 1)).astype(np.float32),
                 rng.integers(0, 10, size=32 * workers).astype(np.int32))
    else:
        from experiments.lm import model as lm

        params, _, loss_fn = lm.build("tiny", 65, seed)
        batch = rng.integers(0, 65, size=(8 * workers, 33)).astype(np.int32)
    return params, loss_fn, batch


def _local(tree):
    """This process's shard of every worker-stacked array (NumPy)."""
    import jax
    import numpy as np

    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x, tree)


def worker(args) -> None:
    """One process: compile every row, time compute alone, then every rate x row; process 0 writes the JSON."""
    from experiments import distributed

    address, count, pid = distributed.settings(None, None, None)
    distributed.initialize(address, count, pid, heartbeat_timeout=60)

    import jax
    import numpy as np
    import optax

    import compjax as cj
    from compjax import parallel

    client = distributed._client()
    me, n = jax.process_index(), jax.process_count()
    barriers = iter(range(10 ** 9))

    def barrier():
        client.wait_at_barrier(f"link-{next(barriers)}", 600_000)

    def log(msg):
        if me == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    mesh = parallel.make_mesh(n)
    rows = []
    for model in args.models:
        for method in args.methods:
            if method in DILOCO and model != "lm":
                continue
            rows.append((model, method))

    built = {}
    t_build = time.perf_counter()
    for model, method in rows:
        # Process 0 compiles first and fills the persistent compilation cache; the others then load from it
        # (P processes compiling at once on a 2-core machine would take P times as long).
        if me != 0:
            barrier()
        params, loss_fn, batch = model_and_batch(model, n)
        tx = make_tx(model, method, "data")
        p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
        step = parallel.data_parallel_step(loss_fn, tx, mesh, donate=True)
        sharded = parallel.shard_batch(batch, mesh)
        ops = cj.audit_collectives(step, p, s, sharded)
        # compute alone: the same step on this process's device, the compressor without collectives
        tx1 = make_tx(model, method, None)
        local_batch = jax.tree.map(lambda x: x[: x.shape[0] // n], batch)

        def local_step(p1, s1, b, tx1=tx1, loss_fn=loss_fn):
            g = jax.grad(loss_fn)(p1, b)
            u, s1 = tx1.update(g, s1, p1)
            return optax.apply_updates(p1, u), s1

        local = jax.jit(local_step, donate_argnums=(0, 1))
        p1, s1 = jax.tree.map(np.asarray, params), tx1.init(params)
        local.lower(p1, s1, local_batch).compile()
        if me == 0:
            barrier()
        built[(model, method)] = {"p": p, "s": s, "step": step, "batch": sharded, "ops": ops, "local": local,
                                  "p1": p1, "s1": s1, "b1": local_batch}
        print(f"[{time.strftime('%H:%M:%S')}] built {model} {method}: {len(ops)} collectives, "
              f"{sum(o.bytes for o in ops):,} bytes/worker", flush=True)

    def run_steps(r, k, times=None, payloads=None):
        for _ in range(k):
            t0 = time.perf_counter()
            r["p"], r["s"], _ = r["step"](r["p"], r["s"], r["batch"])
            jax.block_until_ready((r["p"], r["s"]))
            if times is not None:
                times.append(time.perf_counter() - t0)
            if payloads is not None:
                payloads.append(int(np.asarray(cj.payload_bytes(_local(r["s"]))).reshape(-1)[0]))

    barrier()  # every process has compiled every step: gloo's first collective waits 30 s at most for its peers
    log(f"built every row in {time.perf_counter() - t_build:.0f} s")
    # run every step twice (and set up gloo's connections) on the unshaped link
    if me == 0:
        set_rate(None)
    for key, r in built.items():
        run_steps(r, 2)
    log("compiled")

    def compute_alone(r, repeats, warm=0):
        """Seconds of the step without collectives, all processes at once (the same load as the window)."""
        barrier()
        ts = []
        for i in range(repeats + warm):
            t0 = time.perf_counter()
            r["p1"], r["s1"] = jax.block_until_ready(r["local"](r["p1"], r["s1"], r["b1"]))
            if i >= warm:
                ts.append(time.perf_counter() - t0)
        return ts

    compute = {}
    for key, r in built.items():
        r["p1"], r["s1"] = jax.tree.map(np.array, r["p1"]), jax.tree.map(np.array, r["s1"])
        compute[key] = compute_alone(r, args.compute_repeats, warm=2)
    barrier()
    log("compute measured")

    results = []
    for label in args.rates:
        bits = RATES[label]
        barrier()
        if me == 0:
            cmd = set_rate(bits)
        barrier()
        # idle baseline: the barriers and heartbeats of a window without steps
        c0 = tc_counters() if me == 0 else None
        t0 = time.perf_counter()
        barrier()
        time.sleep(args.idle_s)
        barrier()
        idle_s = time.perf_counter() - t0
        c1 = tc_counters() if me == 0 else None
        idle = None if me else {"bytes": c1["bytes"] - c0["bytes"], "packets": c1["packets"] - c0["packets"],
                                 "seconds": idle_s}
        for key, r in built.items():
            model, method = key
            steps = DILOCO_WINDOW.get(method, args.steps)
            run_steps(r, args.warmup)
            compute_now = compute_alone(r, args.compute_repeats)  # right before the window, under its load
            barrier()
            c0 = tc_counters() if me == 0 else None
            w0 = time.perf_counter()
            barrier()
            times, payloads = [], []
            run_steps(r, steps, times, payloads)
            barrier()
            wall = time.perf_counter() - w0
            c1 = tc_counters() if me == 0 else None
            if me == 0:
                results.append({"model": model, "method": method, "rate": label, "bits_per_s": bits,
                                "steps": steps, "step_s": times, "window_s": wall, "payload_bytes": payloads,
                                "compute_s": compute_now,
                                "kernel_bytes": c1["bytes"] - c0["bytes"],
                                "kernel_packets": c1["packets"] - c0["packets"],
                                "dropped": c1["dropped"] - c0["dropped"], "idle": idle, "tc": cmd})
                log(f"{label} {model} {method}: median step {statistics.median(times) * 1e3:.1f} ms, "
                    f"{(c1['bytes'] - c0['bytes']) / steps:,.0f} kernel bytes/step")
    barrier()
    if me == 0:
        out = {"processes": n, "rows": [
            {"model": m, "method": k, "ops": [{"op": o.op, "operands": [[d, list(s)] for d, s in o.operands],
                                               "bytes": o.bytes} for o in built[(m, k)]["ops"]],
               "compute_s": compute[(m, k)]} for m, k in rows], "measurements": results}
        Path(args.result).write_text(json.dumps(out))
    distributed.finish()


# ----------------------------------------------------------------------------------------------------------------
# Predictions beside measurements.

#: bytes per element of the dtypes the audited collectives carry (HLO names).
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                 "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def predicted_wire_bytes(ops, workers: int, framing=None) -> int:
    """Bytes the audited collectives ``ops`` put on the link in one step, all ``workers`` together.

    ``ops``: dicts ``{"op", "operands": [[dtype, shape], ...]}`` (the JSON form of
    :class:`compjax.accounting.Collective`); every operand is one gloo call
    (:func:`compjax.netmodel.wire_bytes` with ``framing``, default gloo over TCP).
    """
    from compjax import netmodel

    total = 0
    for o in ops:
        for dtype, shape in o["operands"]:
            eb = ELEMENT_BYTES[dtype]
            total += netmodel.wire_bytes(o["op"], math.prod(shape) * eb, workers, framing, element_bytes=eb)
    return total


def syncs_per_step(method: str) -> float:
    """How often the step's collectives run: every step, or once every H steps (DiLoCo's synchronizations)."""
    return 1.0 / DILOCO[method] if method in DILOCO else 1.0


def kernel_bytes_per_step(m: dict) -> float:
    """The kernel's count over the counted steps, less the idle baseline, per step."""
    return (m["kernel_bytes"] - m["idle"]["bytes"]) / m["steps"]


def _collectives(ops):
    from compjax.accounting import Collective

    return [Collective(o["op"], tuple((d, tuple(sh)) for d, sh in o["operands"]), o["bytes"], "") for o in ops]


def latency_units(ops, workers: int) -> float:
    """Messages in sequence per step as :mod:`compjax.netmodel` counts them (its time at 1 s per message)."""
    from compjax import netmodel

    return netmodel.step_time(_collectives(ops), workers, netmodel.Network(math.inf, 1.0))


def fit_latency(run: dict) -> float:
    """The per-message latency (s) of one process count, fitted on its unshaped rows.

    The median over the unshaped rows that communicate every step of
    ``(measured step - compute alone) / latency_units``, at least 0.  On the
    unshaped loopback the bytes cost next to nothing: what remains is the cost
    of each message's round of the ring (gloo's rendezvous, the processes
    waking one another; with more processes than cores, waiting for a core).
    """
    info = {(r["model"], r["method"]): r for r in run["rows"]}
    fits = []
    for m in run["measurements"]:
        r = info[(m["model"], m["method"])]
        units = latency_units(r["ops"], run["processes"])
        if m["bits_per_s"] is None and m["method"] not in DILOCO and units > 0:
            fits.append((statistics.median(m["step_s"]) - statistics.median(m.get("compute_s") or r["compute_s"])) / units)
    return max(0.0, statistics.median(fits)) if fits else 0.0


def predict(ops, workers: int, bits_per_s: float | None, compute_s: float, method: str,
            latency: float = 0.0) -> dict:
    """:func:`compjax.netmodel.predict_step` of a row at a rate, on the shared loopback.

    Every process's packets cross one token bucket of ``R`` bit/s, so the P
    workers of a ring share it: ``Network(bandwidth = R / 8 / P * payload /
    wire)``, the last factor the framing of :func:`predicted_wire_bytes` (a ring's
    time is then its wire bytes / R), and ``latency`` per message (the loopback
    adds no delay of its own: :func:`fit_latency` measures what the hosts add);
    unlimited: infinite bandwidth.  DiLoCo rows: the synchronization's time
    spread over its H steps.
    """
    from compjax import netmodel

    wire = predicted_wire_bytes(ops, workers)
    payload = predicted_wire_bytes(ops, workers, netmodel.Framing.none)
    if bits_per_s is None or wire == 0:
        bandwidth = math.inf
    else:
        bandwidth = bits_per_s / 8 / workers * payload / wire
    collectives = _collectives(ops)
    every = syncs_per_step(method)
    net = netmodel.Network(bandwidth, latency)
    comm = netmodel.step_time(collectives, workers, net) * every
    if every == 1.0:
        pred = netmodel.predict_step(collectives, workers, net, compute_s)
        assert math.isclose(pred.comm_s, comm)
    return {"wire_bytes": wire * every, "payload_traffic": payload * every, "comm_s": comm,
            "no_overlap_s": compute_s + comm, "overlap_s": max(compute_s, comm)}


def build_report(raw: list[dict], argv: list[str], wall_s: float, provenance: dict | None = None) -> dict:
    """Every measurement with its prediction, speedups over dense, and the checks of the issue's targets."""
    from compjax import netmodel

    rows, latencies = [], {}
    for run in raw:
        n = run["processes"]
        latencies[n] = fit_latency(run)
        info = {(r["model"], r["method"]): r for r in run["rows"]}
        for m in run["measurements"]:
            r = info[(m["model"], m["method"])]
            compute_s = statistics.median(m.get("compute_s") or r["compute_s"])  # measured beside the window
            pr = predict(r["ops"], n, m["bits_per_s"], compute_s, m["method"], latencies[n])
            kernel = kernel_bytes_per_step(m)
            step = statistics.median(m["step_s"])
            if m["method"] in DILOCO:  # the window's mean step: the synchronizations' time spread over it
                step = statistics.fmean(m["step_s"])
            rows.append({
                "processes": n, "model": m["model"], "method": m["method"], "rate": m["rate"],
                "bits_per_s": m["bits_per_s"], "steps": m["steps"],
                "payload_bytes_per_worker": statistics.fmean(m["payload_bytes"]),
                "audited_bytes_per_worker": sum(o["bytes"] for o in r["ops"]) * syncs_per_step(m["method"]),
                "predicted_wire_bytes": pr["wire_bytes"], "payload_traffic": pr["payload_traffic"],
                "kernel_bytes": kernel, "kernel_packets": (m["kernel_packets"] - m["idle"]["packets"]) / m["steps"],
                "bytes_ratio": kernel / pr["wire_bytes"] if pr["wire_bytes"] else math.nan,
                "dropped": m["dropped"], "compute_s": compute_s, "step_s": step,
                "step_min_s": min(m["step_s"]), "step_max_s": max(m["step_s"]),
                "predicted_comm_s": pr["comm_s"], "predicted_no_overlap_s": pr["no_overlap_s"],
                "predicted_overlap_s": pr["overlap_s"], "time_ratio": step / pr["no_overlap_s"],
            })
    for r in rows:  # speedups over dense (identity) on the same model, P and rate
        base = next((b for b in rows if b["method"] == "identity" and
                     (b["processes"], b["model"], b["rate"]) == (r["processes"], r["model"], r["rate"])), None)
        r["speedup"] = base["step_s"] / r["step_s"] if base else None
        r["predicted_speedup"] = base["predicted_no_overlap_s"] / r["predicted_no_overlap_s"] if base else None
    shaped = [r for r in rows if r["rate"] in ("10 Mbit/s", "100 Mbit/s")]
    checks = {
        "bytes_within_10pct": all(abs(r["bytes_ratio"] - 1) <= 0.10 for r in rows if r["predicted_wire_bytes"]),
        "max_bytes_error": max((abs(r["bytes_ratio"] - 1) for r in rows if r["predicted_wire_bytes"]), default=0),
        "time_within_25pct_at_10_100": all(abs(r["time_ratio"] - 1) <= 0.25 for r in shaped),
        "time_misses": [f"P={r['processes']} {r['model']} {r['method']} {r['rate']}: {r['time_ratio']:.2f}x"
                        for r in shaped if abs(r["time_ratio"] - 1) > 0.25],
        "no_drops": all(r["dropped"] == 0 for r in rows),
    }
    try:
        import jax
        jax_version = jax.__version__
    except ImportError:  # pragma: no cover
        jax_version = None
    if provenance is None:
        provenance = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                      "jax": jax_version, "loadavg_end": os.getloadavg()}
    return {"command": f"{PROG} {shlex.join(argv)}".strip(), "argv": list(argv), "wall_s": wall_s,
            "framing": netmodel.Framing.gloo_tcp._asdict(), "mtu": MTU, "provenance": provenance,
            "latency_s": {str(k): v for k, v in latencies.items()},
            "checks": checks, "rows": rows, "raw": raw}


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _speedup(r: dict | None) -> str:
    return "" if r is None else f"{r['speedup']:.2f}× / {r['predicted_speedup']:.2f}×"


def to_markdown(report: dict) -> str:
    """The tables of a report: every row's bytes and times, measured beside predicted."""
    c = report["checks"]
    lines = [f"<!-- generated by {report['command']} -->",
             "Kernel-counted bytes (`tc -s qdisc`, every packet of every process, less an idle baseline) and "
             "step times of P data-parallel processes (gloo over TCP, loopback of a fresh network namespace, "
             f"MTU {report['mtu']}, shaped by a token bucket), beside compjax's predictions "
             "(`cj.netmodel.wire_bytes` with `Framing.gloo_tcp` for the bytes, `cj.netmodel.predict_step` at "
             "R / P per worker, the loopback being shared, with the measured compute time and the per-message "
             "latency fitted on the unshaped rows: "
             + ", ".join(f"{float(v) * 1e3:.2f} ms at P = {k}" for k, v in report.get("latency_s", {}).items())
             + "). "
             f"Bytes: largest error {c['max_bytes_error']:.1%} "
             f"({'all rows within 10%' if c['bytes_within_10pct'] else 'some rows beyond 10%'}). "
             "Times at 10 and 100 Mbit/s: "
             + ("all rows within 25%." if c["time_within_25pct_at_10_100"] else
                "beyond 25%: " + "; ".join(c["time_misses"]) + ".")
             + f" Whole run {report['wall_s'] / 60:.1f} min on {report['provenance']['cpus']} CPU cores shared "
             f"with other jobs (load average {report['provenance']['loadavg_end'][2]:.0f} over the last 15 minutes "
             "at the end): a step that waited for a core shows as communication.", ""]
    speed = [r for r in report["rows"] if r["processes"] == max(x["processes"] for x in report["rows"])
             and r["rate"] in ("100 Mbit/s", "unlimited") and r["speedup"] is not None]
    if speed:
        title = (f"Speedup over dense (identity) of the same model, P = {speed[0]['processes']}, measured "
                 "(median steps) / predicted (no overlap); below 1× compression loses:")
        lines += [title, "",
                  "| model | method | 100 Mbit/s | unlimited |", "|---|---|---|---|"]
        for r in speed:
            if r["rate"] != "100 Mbit/s":
                continue
            u = next((x for x in speed if x["rate"] == "unlimited" and (x["model"], x["method"]) ==
                      (r["model"], r["method"])), None)
            lines.append(f"| {r['model']} | {r['method']} | {_speedup(r)} | {_speedup(u)} |")
        lines += ["", "Every row:", ""]
    header = ("| P | model | method | rate | payload B/worker/step | predicted wire B/step | kernel B/step | "
              "kernel / predicted | compute (ms) | measured step (ms), median [min, max] | predicted step (ms), "
              "no overlap / overlap | measured / predicted | speedup over dense, measured / predicted |")
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for r in report["rows"]:
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}× / {r['predicted_speedup']:.2f}×"
        lines.append(
            f"| {r['processes']} | {r['model']} | {r['method']} | {r['rate']} | {r['payload_bytes_per_worker']:,.0f} | "
            f"{r['predicted_wire_bytes']:,.0f} | {r['kernel_bytes']:,.0f} | {r['bytes_ratio']:.3f} | "
            f"{_ms(r['compute_s'])} | {_ms(r['step_s'])} [{_ms(r['step_min_s'])}, {_ms(r['step_max_s'])}] | "
            f"{_ms(r['predicted_no_overlap_s'])} / {_ms(r['predicted_overlap_s'])} | {r['time_ratio']:.2f} | {sp} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Measured vs predicted (no overlap) step time, one panel per model, colour = rate, marker = P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in report["rows"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 5), squeeze=False)
    colours = dict(zip(RATES, ("tab:red", "tab:orange", "tab:green", "tab:blue")))
    markers = {2: "o", 4: "s"}
    for ax, model in zip(axes[0], models):
        rs = [r for r in report["rows"] if r["model"] == model]
        for r in rs:
            ax.scatter(r["predicted_no_overlap_s"] * 1e3, r["step_s"] * 1e3, c=colours.get(r["rate"], "k"),
                       marker=markers.get(r["processes"], "^"), s=30)
            ax.annotate(r["method"].split("(")[0], (r["predicted_no_overlap_s"] * 1e3, r["step_s"] * 1e3),
                        fontsize=6, alpha=0.7)
        lo = min(min(r["step_s"], r["predicted_no_overlap_s"]) for r in rs) * 1e3 * 0.8
        hi = max(max(r["step_s"], r["predicted_no_overlap_s"]) for r in rs) * 1e3 * 1.25
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="k", alpha=0.07)
        ax.set(xscale="log", yscale="log", xlabel="predicted step, no overlap (ms)", ylabel="measured step (ms)",
               title=f"{model}: measured vs cj.netmodel (band: ±25%)")
        for rate, col in colours.items():
            ax.scatter([], [], c=col, label=rate)
        for p, mk in markers.items():
            ax.scatter([], [], c="gray", marker=mk, label=f"P = {p}")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict, out_dir: Path) -> None:
    """``link.json``, ``link.md`` and ``link.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "link.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "link.md").write_text(to_markdown(report))
    plot(report, out_dir / "link.png")
    print(to_markdown(report))
    print(f"wrote {out_dir / 'link.json'}, link.md, link.png")


# ----------------------------------------------------------------------------------------------------------------
# The driver.


def run_processes(processes: int, args, log_dir: Path) -> dict:
    """Start ``processes`` workers through :mod:`experiments.launch` inside a new network namespace."""
    result = log_dir / "result.json"
    worker_args = ["--worker", "--result", str(result), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--compute-repeats", str(args.compute_repeats), "--idle-s", str(args.idle_s),
                   "--models", *args.models, "--methods", *args.methods, "--rates", *args.rates]
    launch = [sys.executable, "-m", "experiments.launch", "--processes", str(processes), "--devices-per-process",
              "1", "--module", "experiments.benchmarks.link", "--log-dir", str(log_dir), "--", *worker_args]
    inner = f"ip link set lo up && ip link set lo mtu {MTU} && exec nice -n {args.nice} {shlex.join(launch)}"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher sets one device per process
    # a compilation cache of this run only: process 0 compiles each program, the others (and P = 4 for the
    # single-device programs P = 2 compiled) load it
    env.update(JAX_COMPILATION_CACHE_DIR=str(log_dir.parent / "jax-cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    r = subprocess.run(["unshare", "-n", "sh", "-c", inner], cwd=REPO, env=env, text=True, capture_output=True,
                       check=False)
    if r.returncode != 0 or not result.exists():
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(log_dir.glob("process_*.log")))
        raise RuntimeError(f"{processes} processes failed (exit {r.returncode}):\n{r.stdout}{r.stderr}{logs}")
    return json.loads(result.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rates", nargs="+", default=list(RATES), choices=list(RATES))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--methods", nargs="+", default=[*COMPRESSORS, *DILOCO], choices=[*COMPRESSORS, *DILOCO])
    ap.add_argument("--steps", type=int, default=3, help="counted steps per row (DiLoCo rows: their window)")
    ap.add_argument("--warmup", type=int, default=1, help="steps before counting, at each rate")
    ap.add_argument("--compute-repeats", type=int, default=5)
    ap.add_argument("--idle-s", type=float, default=2.0, help="seconds of the idle baseline window per rate")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the processes (added to the driver's)")
    ap.add_argument("--quick", action="store_true", help="2 processes, dense CNN, 100 Mbit/s, 3 steps")
    ap.add_argument("--publish", action="store_true", help="write to experiments/results/benchmarks")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild link.md, link.png and the predictions in link.json from the measurements already "
                         "in the output folder's link.json (no processes started)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.processes, args.models, args.methods, args.rates, args.steps = [2], ["cnn"], ["identity"], \
            ["100 Mbit/s"], 3
    out_dir = args.out_dir or (PUBLISHED if args.publish else RUNS)
    if args.report_only:
        old = json.loads((out_dir / "link.json").read_text())
        argv = old.get("argv", shlex.split(old["command"])[len(shlex.split(PROG)):])
        write(build_report(old["raw"], argv, old["wall_s"], old["provenance"]), out_dir)
        return 0
    why = permitted()
    if why is not None:
        print(f"link benchmark skipped: {why} (needs root or CAP_SYS_ADMIN + CAP_NET_ADMIN for unshare -n and tc)")
        return 0
    t0 = time.time()
    raw = []
    with tempfile.TemporaryDirectory(prefix="link-") as tmp:
        for p in args.processes:
            print(f"{p} processes ...", flush=True)
            raw.append(run_processes(p, args, Path(tmp) / f"p{p}"))
    report = build_report(raw, argv=sys.argv[1:] if argv is None else argv, wall_s=time.time() - t0)
    write(report, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
