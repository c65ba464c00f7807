"""Measured on a real link: data-parallel processes over a rate-limited network, bytes counted by the kernel.

    python -m experiments.benchmarks.link                      # P = 2 and 4, unshaped .. 10 Mbit/s (root)
    python -m experiments.benchmarks.link --publish --wait-load 1.5   # the committed experiments/results/benchmarks/link.*
    python -m experiments.benchmarks.link --quick              # 2 processes, dense CNN, 100 Mbit/s, 3 steps
    python -m experiments.benchmarks.link --publish --report-only   # the tables again from the committed JSON

Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN): each process count runs in a
fresh network namespace (``unshare -n``) whose loopback is brought up with a
1500-byte MTU (Ethernet framing) and shaped by a token bucket
(``tc qdisc ... tbf rate R``).  Where a namespace or ``tc`` is not permitted the
script says so in one line and exits 0 without a table.

Inside the namespace, :mod:`experiments.launch` starts P processes of this
module (``--worker``), one CPU device each, joined by ``jax.distributed``; their
collectives go through gloo over TCP on that loopback.  One launch per P runs
every rate.  Every row trains a model with one method:

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
and the time of a step do not depend on the values.

**Building.**  Process 0 compiles every program (the step, the same step
without collectives, the parameter and state initializations, the probe) and
hands the executable to the others through the coordination service: JAX's
persistent cache keys a CPU program by the process that compiled it, so each
process would otherwise compile everything itself.  The serialized
executables are kept in ``runs/benchmarks/link-executables`` (git-ignored,
``--cache-dir``): a second run compiles nothing.

**Measuring**, per P, rate and row (the rates fastest first):

* the latency probe, at every rate: all-reduces and all-gathers of one
  float32, back to back; :func:`probe_latency` makes it the cost of one
  collective call on these hosts;
* a window of steps (:func:`window`: about ``--window-s`` seconds, between
  ``--min-steps`` and ``--max-steps``; DiLoCo rows: their window), each step
  right after the same step without collectives (the compressor's
  ``axis_name=None``, all processes at once, the slowest per step): compute
  and step see the same load.  A step lasts from its last process starting it
  to its last process finishing it (:func:`global_steps`; the processes of a
  host share one monotonic clock); the row's step time is the median over the
  window (DiLoCo rows: the mean, their synchronization spread over it);
* the bytes the kernel put on the link during the window: ``tc -s qdisc
  show dev lo`` "Sent N bytes" (every packet of every process, TCP/IP headers
  and acknowledgements included), less an idle baseline (the coordination
  service's heartbeats and the barriers around a window, over a window
  without steps at that rate).

Beside each measurement: what compjax predicts.  Bytes:
:func:`compjax.netmodel.wire_bytes` of every audited collective
(:func:`compjax.audit_collectives` of the step; the payload bytes per worker
equal ``cj.payload_bytes``) at P processes, with gloo's algorithms and TCP/IP
framing (:data:`compjax.netmodel.Framing.gloo_tcp`).  Time: :func:`predict`,
i.e. :func:`compjax.netmodel.predict_step` on ``Network(R / 8, shared=True,
call_latency=α)`` with that framing and the measured compute time: every
process's packets cross the one token bucket, and each gloo call takes the
longer of its bytes' time and α.

Step times are noisy where other jobs share the CPU (``--wait-load`` waits for
a quieter moment; the load averages at the start and the end are recorded).
The bytes do not depend on the load.

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

from compjax import netmodel

PROG = "python -m experiments.benchmarks.link"
REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "runs" / "benchmarks"
PUBLISHED = REPO / "experiments" / "results" / "benchmarks"

#: Rates of the token bucket: label -> bits per second (None: no bucket, the loopback as it is).
RATES = {"10 Mbit/s": 10e6, "100 Mbit/s": 100e6, "1 Gbit/s": 1e9, "unlimited": None}
#: The order the rates are measured in: the unshaped link first (the latency probe runs there anyway).
MEASURE_ORDER = ("unlimited", "1 Gbit/s", "100 Mbit/s", "10 Mbit/s")
#: The link's MTU (bytes): Ethernet's, so TCP sends segments of at most 1448 payload bytes.
MTU = 1500
#: Methods per model; the DiLoCo rows only for the transformer (the LM testbed's methods).
COMPRESSORS = ("identity", "cast(bfloat16)", "topk(0.01)", "dgc(0.001)", "powersgd(rank=2)", "onebit")
DILOCO = {"diloco(H=50)": 50, "streaming diloco(H=13)": 13}
#: Steps of a DiLoCo row's window: a multiple of its H (and of 4 fragments' cycle for Streaming DiLoCo).
DILOCO_WINDOW = {"diloco(H=50)": 50, "streaming diloco(H=13)": 52}
MODELS = ("cnn", "lm")
#: The rates whose step times the model must meet within 25%.
SHAPED = ("10 Mbit/s", "100 Mbit/s")
#: The collectives of gloo's latency probe: one float32 each, on the unshaped link.
PROBES = ("all-reduce", "all-gather")
#: Compute time a row's window length is planned with (s): the steps' own compute is not known in advance.
ESTIMATED_COMPUTE_S = 0.02
#: A row whose step is estimated at this many seconds or more gets no warm-up step at a rate.
SLOW_STEP_S = 1.0
#: The compiled programs of earlier runs (git-ignored): a second run loads every step instead of compiling it.
CACHE = RUNS / "link-executables"


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


def model_and_batch(model: str, workers: int, seed: int = 0, init=None):
    """``(params, loss_fn, global_batch)`` of a model, with a synthetic batch for ``workers`` workers.

    ``init``: None (the model's parameters built eagerly), or a function that
    runs a function of no argument returning the parameters (:func:`worker`
    passes one that compiles it once for every process).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    if model == "cnn":
        from experiments import models

        def build():
            return models.build(seed)

        batch = (rng.normal(size=(32 * workers, 28, 28, 1)).astype(np.float32),
                 rng.integers(0, 10, size=32 * workers).astype(np.int32))
    else:
        from experiments.lm import model as lm

        def build():
            return lm.build("tiny", 65, seed)

        batch = rng.integers(0, 65, size=(8 * workers, 33)).astype(np.int32)
    if init is None:
        params, _, loss_fn = build()
        return params, loss_fn, batch
    # traced once: loss_fn keeps the traced template only for its structure (every call replaces its values)
    held = {}

    def params_only():
        params, _, held["loss_fn"] = build()
        return params

    return init(params_only), held["loss_fn"], batch


def ops_json(ops) -> list[dict]:
    """Audited collectives as JSON: ``{"op", "operands": [[dtype, shape], ...], "bytes"}`` each."""
    return [{"op": o.op, "operands": [[d, list(s)] for d, s in o.operands], "bytes": o.bytes} for o in ops]


def _payload_paths(state) -> list[int]:
    """Positions (in ``jax.tree.leaves`` order) of a state's ``payload_bytes`` counters."""
    import jax

    return [i for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(state))
            if re.search(r"payload_bytes\W*$", jax.tree_util.keystr(path))]


def _read_counters(state, paths: list[int]) -> list:
    """Copies of this process's shard of the counters at ``paths`` (cheap: a few words each)."""
    import jax
    import numpy as np

    leaves = jax.tree.leaves(state)
    return [np.array(leaves[i].addressable_data(0)) for i in paths]


def _counted_bytes(counters: list) -> int:
    """Bytes the counters say this worker put into collectives in the step they were read after."""
    from compjax import bytecount

    return sum(int(bytecount.to_int(w).reshape(-1)[0]) for w in counters)


def window(ops, workers: int, bits_per_s: float | None, method: str, args) -> tuple[int, int]:
    """``(counted steps, warm-up steps)`` of a row at a rate, the same on every process.

    DiLoCo rows: their window (every fragment synchronizes the same number of
    times in it).  Others: about ``args.window_s`` seconds of steps, estimated
    from the wire bytes at the rate and :data:`ESTIMATED_COMPUTE_S`, between
    ``args.min_steps`` and ``args.max_steps``; no warm-up for a step estimated
    at :data:`SLOW_STEP_S` or more (its transfer dwarfs what a warm-up settles).
    """
    if method in DILOCO:
        return DILOCO_WINDOW[method], args.warmup
    est = ESTIMATED_COMPUTE_S + (predicted_wire_bytes(ops, workers) * 8 / bits_per_s if bits_per_s else 0.0)
    steps = min(args.max_steps, max(args.min_steps, math.ceil(args.window_s / est)))
    return steps, (args.warmup if est < SLOW_STEP_S else 0)


def executable_path(cache_dir: Path, lowered, mesh) -> Path:
    """Where :func:`worker` keeps a program's serialized executable: named by the hash of all that makes it."""
    import hashlib

    import jax

    key = "\n".join([jax.__version__, os.environ.get("XLA_FLAGS", ""), platform.machine(),
                     repr([(d.id, d.process_index) for d in mesh.devices.flat]), lowered.as_text()])
    return Path(cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()}.exe"


def local_program(loss_fn, tx, mesh):
    """Every worker's step on its own device, ``tx`` without collectives (``axis_name=None``): compute alone.

    One SPMD program over the mesh (so process 0 compiles it for all), worker-stacked
    parameters and state in and out as the data-parallel step's; nothing crosses the link.
    """
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    def body(p, s, b):
        p, s = jax.tree.map(lambda x: x[0], (p, s))
        g = jax.grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return jax.tree.map(lambda x: x[None], (optax.apply_updates(p, u), s))

    # check_vma=False: the compressor sees its gradients as one worker's (it refuses axis_name=None otherwise)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False),
                   donate_argnums=(0, 1))


def global_steps(marks: list[list[list[float]]]) -> list[float]:
    """Step durations from every process's ``[start, end]`` of each step (seconds on one clock).

    A synchronous step starts when its last process starts it (the others wait
    in its first collective) and is over when its last process is done: step i
    lasts ``max_p end[p][i] - max_p start[p][i]``.  One process running ahead
    (it received its part of an all-gather first) does not shorten the step.
    """
    k = len(marks[0])
    if any(len(m) != k for m in marks):
        raise ValueError(f"every process must give the same number of steps, got {[len(m) for m in marks]}")
    return [max(m[i][1] for m in marks) - max(m[i][0] for m in marks) for i in range(k)]


def worker(args) -> None:
    """One process: build every row, time gloo's latency, then every rate x row; process 0 writes the JSON."""
    from experiments import distributed

    address, count, pid = distributed.settings(None, None, None)
    distributed.initialize(address, count, pid, heartbeat_timeout=60)

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import compjax as cj
    from compjax import parallel

    client = distributed._client()
    me, n = jax.process_index(), jax.process_count()
    ids = iter(range(10 ** 9))  # every process draws the same ids in the same order
    load_start = os.getloadavg()

    def barrier():
        client.wait_at_barrier(f"link-{next(ids)}", 600_000)

    def gather(value):
        """Every process's ``value`` (JSON-able) at process 0, in process order; None elsewhere."""
        key = f"link-kv-{next(ids)}"
        client.key_value_set(f"{key}/{me}", json.dumps(value))
        if me:
            return None
        return [json.loads(client.blocking_key_value_get(f"{key}/{i}", 600_000)) for i in range(n)]

    def log(msg):
        if me == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    mesh = parallel.make_mesh(n)
    rows = [(model, method) for model in args.models for method in args.methods
            if not (method in DILOCO and model != "lm")]

    def compiled(lowered):
        """``lowered.compile()`` on process 0, handed to the others as its serialized executable.

        JAX's persistent compilation cache keys a CPU program by the process that
        compiled it (each process would compile every program itself: P times the
        work on a machine of 2 cores), and an executable it loaded cannot be
        serialized again; so process 0 alone compiles each program, keeps its
        serialized executable in ``args.cache_dir`` (a later run loads it) and
        hands it to the others through the coordination service."""
        from jax.experimental import serialize_executable

        key = f"link-exe-{next(ids)}"
        if me == 0:
            path = executable_path(args.cache_dir, lowered, mesh)
            if path.exists():
                payload = path.read_bytes()
            else:
                payload = serialize_executable.serialize(lowered.compile())[0]
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_bytes(payload)
                tmp.replace(path)
            client.key_value_set_bytes(key, payload)
        else:
            payload = client.blocking_key_value_get_bytes(key, 1_800_000)
        return serialize_executable.deserialize_and_load(payload, lowered.in_tree, lowered.out_tree,
                                                         execution_devices=list(mesh.devices.flat))

    def stacked(f, params):
        """``f(params)`` as the data-parallel steps take it: every leaf worker-stacked, ``P("data")``.

        One program over the mesh (compiled once, by process 0) instead of eager
        operations, which every process would compile one by one."""
        def g(q):
            return jax.tree.map(lambda x: jax.numpy.broadcast_to(x[None], (n, *x.shape)), f(q))

        return compiled(jax.jit(g, out_shardings=NamedSharding(mesh, P("data"))).lower(params))(params)

    models, built = {}, {}
    t_build = time.perf_counter()
    log(f"started in {time.perf_counter() - args.t0:.1f} s" if args.t0 else "started")
    for model, method in rows:
        marks = [time.perf_counter()]
        if model not in models:
            params, loss_fn, batch = model_and_batch(model, n, init=lambda f: compiled(
                jax.jit(f, out_shardings=NamedSharding(mesh, P())).lower())())
            models[model] = (params, loss_fn, parallel.shard_batch(batch, mesh))
        params, loss_fn, sharded = models[model]
        tx = make_tx(model, method, "data")
        p, s = stacked(lambda q: q, params), stacked(tx.init, params)
        marks.append(time.perf_counter())
        # one compilation, audited and run: the audit reads the very program that runs
        step = compiled(parallel.data_parallel_step(loss_fn, tx, mesh, donate=True).lower(p, s, sharded))
        ops = cj.audit_collectives(step)  # on every process: the window lengths are planned from it
        marks.append(time.perf_counter())
        # compute alone: the same step with the compressor's axis_name=None (no collective), on every process
        tx1 = make_tx(model, method, None)
        p1, s1 = stacked(lambda q: q, params), stacked(tx1.init, params)
        local = compiled(local_program(loss_fn, tx1, mesh).lower(p1, s1, sharded))
        if me == 0 and cj.audit_collectives(local):
            raise RuntimeError(f"{model} {method}: the step without collectives has some")
        marks.append(time.perf_counter())
        built[(model, method)] = {"p": p, "s": s, "step": step, "batch": sharded, "ops": ops_json(ops),
                                  "local": local, "p1": p1, "s1": s1, "counters": _payload_paths(s)}
        log(f"built {model} {method} in {marks[-1] - marks[0]:.1f} s (model and state "
            f"{marks[1] - marks[0]:.1f}, step {marks[2] - marks[1]:.1f}, without collectives "
            f"{marks[3] - marks[2]:.1f}): {len(ops)} collectives, {sum(o.bytes for o in ops):,} bytes/worker")

    # gloo's own cost: the smallest all-reduce and all-gather, nothing else in the program
    sharding = NamedSharding(mesh, P("data"))
    probes = {}
    for kind in PROBES:
        def f(x, kind=kind):
            return jax.lax.psum(x, "data") if kind == "all-reduce" else jax.lax.all_gather(x, "data").sum(0)

        x = jax.make_array_from_process_local_data(sharding, np.ones((1,), np.float32), (n,))
        fn = compiled(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))).lower(x))
        probes[kind] = (fn, x, ops_json(cj.audit_collectives(fn)))

    def run_steps(r, k):
        for _ in range(k):
            r["p"], r["s"], _ = r["step"](r["p"], r["s"], r["batch"])
            jax.block_until_ready((r["p"], r["s"]))

    barrier()  # every process has built every row: gloo's first collective waits 30 s at most for its peers
    log(f"built every row in {time.perf_counter() - t_build:.0f} s")
    # set up gloo's connections and run every program twice, on the unshaped link
    if me == 0:
        set_rate(None)
    barrier()
    for r in built.values():
        run_steps(r, 2)
        r["p1"], r["s1"] = jax.block_until_ready(r["local"](r["p1"], r["s1"], r["batch"]))
    for fn, x, _ in probes.values():
        jax.block_until_ready(fn(x))
        jax.block_until_ready(fn(x))
    log("compiled and connected")

    def probe(label):
        """gloo's cost per call at this rate: the probes back to back, process 0's times (None elsewhere)."""
        out = {}
        for kind, (fn, x, ops) in probes.items():
            barrier()
            ts = []
            for _ in range(args.probe_repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x))
                ts.append(round(time.perf_counter() - t0, 6))
            everyone = gather(ts)
            if me == 0:
                out[kind] = {"elements": 1, "ops": ops, "times_s": everyone[0],
                             "median_s": statistics.median(everyone[0]), "min_s": min(everyone[0])}
                log(f"{label} {kind} of one float32: median {out[kind]['median_s'] * 1e3:.2f} ms, "
                    f"min {out[kind]['min_s'] * 1e3:.2f} ms")
        return out

    latency = {}
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
        latency[label] = probe(label)
        for i, (key, r) in enumerate(built.items()):
            model, method = key
            steps, warmup = window(r["ops"], n, bits, method, args)
            run_steps(r, max(warmup, 1 if i == 0 else 0))  # the first row settles TCP at the new rate
            barrier()
            c0 = tc_counters() if me == 0 else None
            barrier()
            # each step right after the same step without collectives: the two see the same load
            marks, compute, counters = [], [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                r["p1"], r["s1"] = jax.block_until_ready(r["local"](r["p1"], r["s1"], r["batch"]))
                t1 = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the host
                r["p"], r["s"], _ = r["step"](r["p"], r["s"], r["batch"])
                jax.block_until_ready((r["p"], r["s"]))
                marks.append((t1, time.perf_counter()))
                compute.append(round(t1 - t0, 6))
                counters.append(_read_counters(r["s"], r["counters"]))
            barrier()
            c1 = tc_counters() if me == 0 else None
            everyone = gather({"marks": marks, "compute": compute})
            if me == 0:
                t_min = min(e["marks"][0][0] for e in everyone)
                m = {"model": model, "method": method, "rate": label, "bits_per_s": bits, "steps": steps,
                     "warmup": warmup,
                     "marks_s": [[[round(a - t_min, 6), round(b - t_min, 6)] for a, b in e["marks"]]
                                 for e in everyone],
                     "compute_by_process_s": [e["compute"] for e in everyone],
                     "payload_bytes": [_counted_bytes(c) for c in counters],
                     "kernel_bytes": c1["bytes"] - c0["bytes"], "kernel_packets": c1["packets"] - c0["packets"],
                     "dropped": c1["dropped"] - c0["dropped"], "idle": idle, "tc": cmd}
                m["step_s"] = [round(t, 6) for t in global_steps(m["marks_s"])]
                m["compute_s"] = [max(c) for c in zip(*m["compute_by_process_s"])]
                results.append(m)
                log(f"{label} {model} {method}: {steps} steps, median {statistics.median(m['step_s']) * 1e3:.1f} ms "
                    f"(compute {statistics.median(m['compute_s']) * 1e3:.1f} ms), "
                    f"{(c1['bytes'] - c0['bytes']) / steps:,.0f} kernel bytes/step")
    barrier()
    if me == 0:
        out = {"processes": n, "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "latency_probe": latency,
               "rows": [{"model": m, "method": k, "ops": built[(m, k)]["ops"]} for m, k in rows],
               "measurements": results}
        Path(args.result).write_text(json.dumps(out))
    distributed.finish()


# ----------------------------------------------------------------------------------------------------------------
# Predictions beside measurements.

#: bytes per element of the dtypes the audited collectives carry (HLO names).
ELEMENT_BYTES = netmodel.ELEMENT_BYTES


def predicted_wire_bytes(ops, workers: int, framing=None) -> int:
    """Bytes the audited collectives ``ops`` put on the link in one step, all ``workers`` together.

    ``ops``: dicts ``{"op", "operands": [[dtype, shape], ...]}`` (the JSON form of
    :class:`compjax.accounting.Collective`); every operand is one gloo call
    (:func:`compjax.netmodel.wire_bytes` with ``framing``, default gloo over TCP).
    """
    total = 0
    for o in ops:
        for dtype, shape in o["operands"]:
            eb = netmodel.ELEMENT_BYTES[dtype]
            total += netmodel.wire_bytes(o["op"], math.prod(shape) * eb, workers, framing, element_bytes=eb)
    return total


def syncs_per_step(method: str) -> float:
    """How often the step's collectives run: every step, or once every H steps (DiLoCo's synchronizations)."""
    return 1.0 / DILOCO[method] if method in DILOCO else 1.0


def kernel_bytes_per_step(m: dict) -> float:
    """The kernel's count over the counted steps, less the idle baseline (a window of as many barriers), per step."""
    return (m["kernel_bytes"] - m["idle"]["bytes"]) / m["steps"]


def _collectives(ops):
    from compjax.accounting import Collective

    return [Collective(o["op"], tuple((d, tuple(sh)) for d, sh in o["operands"]), o["bytes"], "") for o in ops]


def probe_latency(run: dict) -> float:
    """Seconds per collective call at one process count: the mean call of its latency probe.

    At every rate the probe times, back to back, an all-reduce and an
    all-gather of one float32 (:data:`PROBES`): nothing to compute and next to
    nothing to send, so what a call costs is the hosts' (waking the P
    processes, gloo's rendezvous, XLA's set-up).  Each call's own wire bytes
    over the rate come off (at least 0 left), then the mean over both kinds and
    every rate: the calls' times are bimodal (about 0.2 ms, or about 4 ms when
    a wake-up waits for the next tick of the kernel's 250 Hz timer), and a
    step of k calls pays k times the mean, which a median would not follow.
    The cost is per call, not per message: the all-reduce (twice the message
    steps of the all-gather) takes about as long.
    """
    times = []
    for rate, probes in run["latency_probe"].items():
        bits = RATES[rate]
        for pr in probes.values():
            own = predicted_wire_bytes(pr["ops"], run["processes"]) * 8 / bits if bits else 0.0
            times += [max(0.0, t - own) for t in pr["times_s"]]
    return statistics.fmean(times) if times else 0.0


def _calls(ops) -> int:
    """Gloo calls of a step: one per operand of each audited collective."""
    return sum(len(o["operands"]) for o in ops)


def predict(ops, workers: int, bits_per_s: float | None, compute_s: float, method: str,
            call_latency: float = 0.0) -> dict:
    """:func:`compjax.netmodel.predict_step` of a row at a rate, on the shared loopback.

    Every process's packets cross one token bucket of ``R`` bit/s:
    ``Network(bandwidth=R / 8, call_latency=..., shared=True)`` with gloo's framing
    (:data:`compjax.netmodel.Framing.gloo_tcp`): each gloo call (one per operand)
    takes the longer of ``call_latency`` and the wire bytes of all its messages
    over ``R``; unlimited: infinite bandwidth.  DiLoCo rows: the
    synchronization's time spread over its H steps.  ``bytes_s`` and
    ``latency_s`` are the two sums the calls' maxima lie between.
    """
    collectives = _collectives(ops)
    every = syncs_per_step(method)
    bandwidth = math.inf if bits_per_s is None else bits_per_s / 8
    net = netmodel.Network(bandwidth, 0.0, shared=True, call_latency=call_latency)
    pred = netmodel.predict_step(collectives, workers, net, compute_s, framing=netmodel.Framing.gloo_tcp)
    comm = pred.comm_s * every
    return {"wire_bytes": predicted_wire_bytes(ops, workers) * every,
            "payload_traffic": predicted_wire_bytes(ops, workers, netmodel.Framing.none) * every,
            "comm_s": comm, "latency_s": _calls(ops) * call_latency * every,
            "bytes_s": 0.0 if bits_per_s is None else predicted_wire_bytes(ops, workers) * 8 / bits_per_s * every,
            "no_overlap_s": compute_s + comm, "overlap_s": max(compute_s, comm)}


def measured_step(m: dict) -> float:
    """A window's step time: the median step (DiLoCo rows: the mean, their synchronization spread over it)."""
    return statistics.fmean(m["step_s"]) if m["method"] in DILOCO else statistics.median(m["step_s"])


def provenance(load_start, waited_s: float = 0.0, wait_limit: float | None = None) -> dict:
    """Where and under what load the run ran (``loadavg_end`` read now)."""
    try:
        import jax
        jax_version = jax.__version__
    except ImportError:  # pragma: no cover
        jax_version = None
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:  # pragma: no cover
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "jax": jax_version, "date": time.strftime("%Y-%m-%d"), "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()), "waited_for_load_s": waited_s, "wait_load_limit": wait_limit}


def build_report(raw: list[dict], argv: list[str], wall_s: float, provenance: dict) -> dict:
    """Every measurement with its prediction, speedups over dense, and the checks of the targets."""
    rows, latencies = [], {}
    for run in raw:
        n = run["processes"]
        latencies[str(n)] = probe_latency(run)
        info = {(r["model"], r["method"]): r for r in run["rows"]}
        for m in run["measurements"]:
            r = info[(m["model"], m["method"])]
            compute_s = statistics.median(m["compute_s"])  # measured beside the window
            pr = predict(r["ops"], n, m["bits_per_s"], compute_s, m["method"], latencies[str(n)])
            kernel = kernel_bytes_per_step(m)
            step = measured_step(m)
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
                "compute_min_s": min(m["compute_s"]), "compute_max_s": max(m["compute_s"]),
                "calls": _calls(r["ops"]), "predicted_latency_s": pr["latency_s"], "predicted_bytes_s": pr["bytes_s"],
                "predicted_comm_s": pr["comm_s"], "predicted_no_overlap_s": pr["no_overlap_s"],
                "predicted_overlap_s": pr["overlap_s"], "time_ratio": step / pr["no_overlap_s"],
            })
    for r in rows:  # speedups over dense (identity) on the same model, P and rate
        base = next((b for b in rows if b["method"] == "identity" and
                     (b["processes"], b["model"], b["rate"]) == (r["processes"], r["model"], r["rate"])), None)
        r["speedup"] = base["step_s"] / r["step_s"] if base else None
        r["predicted_speedup"] = base["predicted_no_overlap_s"] / r["predicted_no_overlap_s"] if base else None
    shaped = [r for r in rows if r["rate"] in SHAPED]
    checks = {
        "bytes_within_10pct": all(abs(r["bytes_ratio"] - 1) <= 0.10 for r in rows if r["predicted_wire_bytes"]),
        "max_bytes_error": max((abs(r["bytes_ratio"] - 1) for r in rows if r["predicted_wire_bytes"]), default=0),
        "time_within_25pct_at_10_100": all(abs(r["time_ratio"] - 1) <= 0.25 for r in shaped),
        "time_rows_within_25pct_at_10_100": sum(abs(r["time_ratio"] - 1) <= 0.25 for r in shaped),
        "time_rows_at_10_100": len(shaped),
        "time_misses": [f"P={r['processes']} {r['model']} {r['method']} {r['rate']}: {r['time_ratio']:.2f}x"
                        for r in shaped if abs(r["time_ratio"] - 1) > 0.25],
        "worst_time_row": max(({"row": _row_name(r), "ratio": r["time_ratio"]} for r in shaped),
                              key=lambda x: abs(math.log(x["ratio"])), default=None),
        "no_drops": all(r["dropped"] == 0 for r in rows),
    }
    misses = [miss_note(r) for r in shaped if abs(r["time_ratio"] - 1) > 0.25]
    return {"command": f"{PROG} {shlex.join(argv)}".strip(), "argv": list(argv), "wall_s": wall_s,
            "framing": netmodel.Framing.gloo_tcp._asdict(), "mtu": MTU, "provenance": provenance,
            "call_latency_s": latencies,
            "checks": checks, "misses": misses, "rows": rows, "raw": raw}


def miss_note(r: dict) -> str:
    """One line on a row beyond 25%: its measured and modelled parts, and the spread of what was measured."""
    return (f"{_row_name(r)}: measured {_ms(r['step_s'])} ms (steps {_ms(r['step_min_s'])} to "
            f"{_ms(r['step_max_s'])}), predicted {_ms(r['predicted_no_overlap_s'])} ms "
            f"({r['time_ratio']:.2f}×) = compute {_ms(r['compute_s'])} (beside the steps {_ms(r['compute_min_s'])} "
            f"to {_ms(r['compute_max_s'])}) + communication {_ms(r['predicted_comm_s'])} (bytes alone "
            f"{_ms(r['predicted_bytes_s'])}, {r['calls']} calls × α {_ms(r['predicted_latency_s'])})")


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _speedup(r: dict | None) -> str:
    return "" if r is None else f"{r['speedup']:.2f}× / {r['predicted_speedup']:.2f}×"


def _row_name(r: dict) -> str:
    return f"P = {r['processes']} {r['model']} {r['method']} {r['rate']}"


def to_markdown(report: dict) -> str:
    """``link.md``: a header saying how and where it was measured, the speedups over dense, every row."""
    c, pv = report["checks"], report["provenance"]
    lat = report.get("call_latency_s", {})
    load0, load1 = pv.get("loadavg_start") or [math.nan] * 3, pv.get("loadavg_end") or [math.nan] * 3
    waited = pv.get("waited_for_load_s") or 0.0
    lines = [
        f"<!-- generated by {report['command']} -->",
        f"Measured with `sudo .venv/bin/{report['command']}` on {pv.get('cpu') or 'a CPU'} "
        f"({pv.get('cpus')} cores shared with other jobs; {pv.get('platform', '')}; jax {pv.get('jax')}), "
        f"{pv.get('date', '')}: {report['wall_s'] / 60:.1f} min in all, with the load average at "
        f"{load0[0]:.2f} (1 min) when it started"
        + (f" (after {waited / 60:.0f} min waiting for it to fall below {pv['wait_load_limit']})"
           if pv.get("wait_load_limit") is not None else "")
        + f" and {load1[0]:.2f} at the end.",
        "",
        "P data-parallel processes (gloo over TCP, one CPU device each) on the loopback of a fresh network "
        f"namespace (MTU {report['mtu']}) that a token bucket (`tc tbf`) shapes to the rate; every process's "
        "packets cross that one bucket. **Bytes**: the kernel's count (`tc -s qdisc`: every packet, TCP/IP "
        "headers and acknowledgements included, less an idle baseline) beside `cj.netmodel.wire_bytes` of the "
        "audited collectives (`Framing.gloo_tcp`). **Step time**: the median over the window of a step's time "
        "from its last process starting it to its last process finishing it (DiLoCo rows: the mean, their one "
        "synchronization spread over it), beside `cj.netmodel.predict_step(ops, P, Network(R / 8, "
        "call_latency=α, shared=True), compute, framing=Framing.gloo_tcp)`: the compute time measured in the "
        "window (the same step without collectives right before each step, all processes at once, the slowest "
        "one's time; the median), the "
        "wire bytes of every collective over the shared rate, each gloo call taking the longer of its bytes' "
        "time and α, the cost of a call on these hosts, measured by the latency probe (the mean of one-float32 "
        "all-reduces and all-gathers back to back at every rate, less their own bytes' time): "
        + ", ".join(f"{float(v) * 1e3:.2f} ms at P = {k}" for k, v in lat.items()) + ".",
        "",
        f"Bytes: within 10% in {'every' if c['bytes_within_10pct'] else 'not every'} row (largest error "
        f"{c['max_bytes_error']:.1%}). Step time at 10 and 100 Mbit/s: within 25% in "
        f"{c['time_rows_within_25pct_at_10_100']} of {c['time_rows_at_10_100']} rows"
        + (f" (worst: {c['worst_time_row']['row']}, measured / predicted {c['worst_time_row']['ratio']:.2f})"
           if c.get("worst_time_row") else "") + ".",
    ]
    if report.get("misses"):
        lines += ["", "Rows beyond 25% at 10 and 100 Mbit/s, with what was measured beside them:", ""]
        lines += [f"- {m}" for m in report["misses"]]
    top = max(x["processes"] for x in report["rows"])
    speed = [r for r in report["rows"] if r["processes"] == top and r["speedup"] is not None]
    if speed:
        lines += ["", (f"Speedup over dense (identity) of the same model, P = {top}, measured / predicted "
                       "(median steps; below 1× compression loses):"), "",
                  "| model | method | 100 Mbit/s | unlimited |", "|---|---|---|---|"]
        for r in speed:
            if r["rate"] != "100 Mbit/s":
                continue
            u = next((x for x in speed if x["rate"] == "unlimited" and (x["model"], x["method"]) ==
                      (r["model"], r["method"])), None)
            lines.append(f"| {r['model']} | {r['method']} | {_speedup(r)} | {_speedup(u)} |")
    header = ("| P | model | method | rate | steps | payload B/worker/step | predicted wire B/step | kernel B/step | "
              "kernel / predicted | compute (ms) | measured step (ms), median [min, max] | predicted step (ms) | "
              "measured / predicted | speedup over dense, measured / predicted |")
    lines += ["", "Every row:", "", header, "|" + "---|" * (header.count("|") - 1)]
    for r in report["rows"]:
        lines.append(
            f"| {r['processes']} | {r['model']} | {r['method']} | {r['rate']} | {r['steps']} | "
            f"{r['payload_bytes_per_worker']:,.0f} | {r['predicted_wire_bytes']:,.0f} | {r['kernel_bytes']:,.0f} | "
            f"{r['bytes_ratio']:.3f} | {_ms(r['compute_s'])} | {_ms(r['step_s'])} [{_ms(r['step_min_s'])}, "
            f"{_ms(r['step_max_s'])}] | {_ms(r['predicted_no_overlap_s'])} | {r['time_ratio']:.2f} | "
            f"{_speedup(r) if r['speedup'] is not None else ''} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Measured vs predicted step time: one panel per (model, P), a marker per method, a colour per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["processes"]) for r in report["rows"]})
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.6 * rows + 0.8), squeeze=False)
    colours = dict(zip(RATES, ("tab:red", "tab:orange", "tab:green", "tab:blue")))
    methods = list(dict.fromkeys(r["method"] for r in report["rows"]))
    markers = dict(zip(methods, "osD^vP*Xh<>p"))
    for ax, (model, n) in zip(axes.flat, panels):
        rs = [r for r in report["rows"] if (r["model"], r["processes"]) == (model, n)]
        for r in rs:
            ax.scatter(r["predicted_no_overlap_s"] * 1e3, r["step_s"] * 1e3, c=colours.get(r["rate"], "k"),
                       marker=markers[r["method"]], s=34, alpha=0.85, edgecolors="none")
        lo = min(min(r["step_s"], r["predicted_no_overlap_s"]) for r in rs) * 1e3 * 0.7
        hi = max(max(r["step_s"], r["predicted_no_overlap_s"]) for r in rs) * 1e3 * 1.4
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="k", alpha=0.07)
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="predicted step (ms)",
               ylabel="measured step (ms)", title=f"{model}, P = {n} (band: ±25%)")
    handles = [plt.Line2D([], [], ls="", marker="o", color=c, label=k) for k, c in colours.items()]
    handles += [plt.Line2D([], [], ls="", marker=m, color="gray", label=k) for k, m in markers.items()]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=7, frameon=False)
    fig.suptitle("cj.netmodel.predict_step vs measured, gloo over a shaped loopback", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _dumps(report: dict) -> str:
    """The report as JSON: indented, but each raw measurement on one line (they hold long lists of numbers)."""
    head = json.dumps({k: v for k, v in report.items() if k != "raw"}, indent=1)
    runs = []
    for run in report["raw"]:
        rest = json.dumps({k: v for k, v in run.items() if k != "measurements"})
        lines = ",\n   ".join(json.dumps(m) for m in run["measurements"])
        runs.append(f'{rest[:-1]}, "measurements": [\n   {lines}]}}')
    return head[:-2] + ',\n "raw": [\n  ' + ",\n  ".join(runs) + "\n ]\n}\n"


def write(report: dict, out_dir: Path) -> None:
    """``link.json``, ``link.md`` and ``link.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "link.json").write_text(_dumps(report))
    (out_dir / "link.md").write_text(to_markdown(report))
    plot(report, out_dir / "link.png")
    print(to_markdown(report))
    print(f"wrote {out_dir / 'link.json'}, link.md, link.png")


# ----------------------------------------------------------------------------------------------------------------
# The driver.


def run_processes(processes: int, args, log_dir: Path) -> dict:
    """Start ``processes`` workers through :mod:`experiments.launch` inside a new network namespace."""
    result = log_dir / "result.json"
    worker_args = ["--worker", "--result", str(result), "--t0", str(time.perf_counter()), "--warmup", str(args.warmup),
                   "--min-steps",
                   str(args.min_steps), "--max-steps", str(args.max_steps), "--window-s", str(args.window_s),
                   "--probe-repeats", str(args.probe_repeats),
                   "--idle-s", str(args.idle_s), "--cache-dir", str(args.cache_dir), "--models", *args.models,
                   "--methods", *args.methods,
                   "--rates", *args.rates]
    launch = [sys.executable, "-m", "experiments.launch", "--processes", str(processes), "--devices-per-process",
              "1", "--module", "experiments.benchmarks.link", "--log-dir", str(log_dir), "--", *worker_args]
    inner = f"ip link set lo up && ip link set lo mtu {MTU} && exec nice -n {args.nice} {shlex.join(launch)}"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher sets one device per process
    r = subprocess.run(["unshare", "-n", "sh", "-c", inner], cwd=REPO, env=env, text=True, capture_output=True,
                       check=False)
    if r.returncode != 0 or not result.exists():
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(log_dir.glob("process_*.log")))
        raise RuntimeError(f"{processes} processes failed (exit {r.returncode}):\n{r.stdout}{r.stderr}{logs}")
    return json.loads(result.read_text())


def wait_for_load(limit: float, max_s: float, poll_s: float = 15.0) -> tuple[float, list[float]]:
    """Sleep until the 1-minute load average is below ``limit`` or ``max_s`` passed: ``(seconds waited, loads)``."""
    t0 = time.time()
    while os.getloadavg()[0] >= limit and time.time() - t0 < max_s:
        print(f"load average {os.getloadavg()[0]:.2f} >= {limit}: waiting ({time.time() - t0:.0f} s so far)",
              flush=True)
        time.sleep(poll_s)
    return time.time() - t0, list(os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rates", nargs="+", default=list(MEASURE_ORDER), choices=list(RATES),
                    help="rates, measured in this order (default: fastest first)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--methods", nargs="+", default=[*COMPRESSORS, *DILOCO], choices=[*COMPRESSORS, *DILOCO])
    ap.add_argument("--min-steps", type=int, default=3, help="counted steps per row at least (DiLoCo rows: their window)")
    ap.add_argument("--max-steps", type=int, default=12, help="counted steps per row at most")
    ap.add_argument("--window-s", type=float, default=0.5, help="seconds of counted steps aimed at per row")
    ap.add_argument("--warmup", type=int, default=1, help="steps before counting, at each rate")
    ap.add_argument("--probe-repeats", type=int, default=40, help="calls of each latency probe")
    ap.add_argument("--idle-s", type=float, default=1.0, help="seconds of the idle baseline window per rate")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the processes (added to the driver's)")
    ap.add_argument("--cache-dir", type=Path, default=CACHE, help="the compiled steps of earlier runs")
    ap.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here (default: discarded)")
    ap.add_argument("--wait-load", type=float, default=None, metavar="L",
                    help="first wait (at most --wait-max-s) until the 1-minute load average is below L")
    ap.add_argument("--wait-max-s", type=float, default=1200.0)
    ap.add_argument("--quick", action="store_true", help="2 processes, dense CNN, 100 Mbit/s, 3 steps")
    ap.add_argument("--publish", action="store_true", help="write to experiments/results/benchmarks")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild link.md, link.png and the predictions in link.json from the measurements already "
                         "in the output folder's link.json (no processes started)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.processes, args.models, args.methods, args.rates = [2], ["cnn"], ["identity"], ["100 Mbit/s"]
        args.min_steps = args.max_steps = 3
        args.probe_repeats, args.idle_s = 10, 0.5
    out_dir = args.out_dir or (PUBLISHED if args.publish else RUNS)
    argv = sys.argv[1:] if argv is None else list(argv)
    if args.report_only:
        old = json.loads((out_dir / "link.json").read_text())
        write(build_report(old["raw"], old["argv"], old["wall_s"], old["provenance"]), out_dir)
        return 0
    why = permitted()
    if why is not None:
        print(f"link benchmark skipped: {why} (needs root or CAP_SYS_ADMIN + CAP_NET_ADMIN for unshare -n and tc)")
        return 0
    waited, load = (0.0, list(os.getloadavg())) if args.wait_load is None else \
        wait_for_load(args.wait_load, args.wait_max_s)
    t0 = time.time()
    raw = []
    with tempfile.TemporaryDirectory(prefix="link-") as tmp:
        for p in args.processes:
            print(f"{p} processes ...", flush=True)
            log_dir = (args.log_dir or Path(tmp)) / f"p{p}"
            raw.append(run_processes(p, args, log_dir))
    report = build_report(raw, argv, time.time() - t0, provenance(load, waited, args.wait_load))
    write(report, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
