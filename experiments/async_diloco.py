"""Decoupled DiLoCo on the character transformer: a syncer and N learners as separate processes.

    python -m experiments.async_diloco --learners 4                       # all on this machine (runs/async_diloco/)
    python -m experiments.async_diloco --learners 4 --steps 600 --sync-every 100 --compressor e3m0
    python -m experiments.async_diloco --learners 4 --lockstep           # lock-step Streaming DiLoCo, same code
    python -m experiments.async_diloco syncer  --address tcp://127.0.0.1:5555 --learners 4 ...   # one role
    python -m experiments.async_diloco learner --address tcp://127.0.0.1:5555 --index 0 ...      # per learner
    python -m experiments.async_diloco keys --keys certs --learners 2                                  # CURVE keys
    python -m experiments.async_diloco syncer  --address tcp://0.0.0.0:5555 --advertise 10.0.0.1 --keys certs ...
    python -m experiments.async_diloco learner --address tcp://10.0.0.1:5555 --index 0 --keys certs ...  # host B

Without a role, the launcher starts one syncer process and ``--learners`` learner processes on this
machine (:class:`compjax.decoupled.MultiProcessTransport`: ZeroMQ control frames, arrays over
``jax.experimental.transfer``), prints the commands that run the same roles one by one (on several
terminals or hosts: the syncer's address is what each learner is given), waits for the learners and
stops the syncer.  Everything a run writes goes to ``--out`` (default ``runs/async_diloco/<time>``,
git-ignored): each learner's statistics (``learner<i>.json``: goodput, tokens/s, bytes counted, delays,
refusals), the syncer's (``syncer.json``: merges, refusals, lost learners, the validation loss of the
global model over the run, the bytes it carried) and the final global parameters (``global.npz``).

**The model and data.**  The LM testbed's character transformer (:mod:`experiments.lm.model`, ``tiny``:
112,512 parameters) on Tiny Shakespeare (:mod:`experiments.lm.data`: ``--text FILE`` reads any text
instead, with no checksum; otherwise ``$COMPJAX_TINYSHAKESPEARE`` or the download cache).  Every learner
starts from the same initialization (``--seed``) and trains with AdamW on its own random windows of the
training split (seed ``(seed, index)``); the syncer evaluates its global parameters on fixed windows of the
validation split.

**The algorithm.**  Asynchronous by default: learners never wait for each other, each fragment's
compressed outer gradient is sent from a background thread while the next inner steps run, and the
syncer merges a fragment once ``--min-quorum`` learners sent it (default all but one, at least 2) or ``--grace-s``
passed.  ``--lockstep`` runs lock-step Streaming DiLoCo with the same processes: ``min_quorum`` = every
learner, no grace limit, and each learner waits for its merged fragment before its next inner step
(with these settings the system computes :func:`compjax.diloco`'s global parameters; see
``tests/test_decoupled_equivalence.py``).

**Transfers.**  :class:`~compjax.decoupled.MultiProcessTransport` receives each learner's merged
fragments on a background thread (the transfers overlap the inner steps), and on the syncer bounds each
contribution's receive by ``--pull-timeout-s`` and stops pulling from a learner whose transfer failed
until it says hello again (a learner killed in the middle of a transfer).

**Several machines.**  The syncer binds ``--address tcp://HOST:PORT`` (HOST one of its IPv4 addresses, or
``0.0.0.0`` / ``*`` for every interface); each learner is given ``--address tcp://SYNCER_IP:PORT``, the
address it reaches the syncer at.  Arrays travel between the processes' ``jax.experimental.transfer``
servers, each bound to the address its peers pull from, ``--advertise HOST`` (an IPv4 address of that
machine).  Without ``--advertise`` the syncer advertises the host it binds (for ``0.0.0.0``: its address on
the default route) and a learner its own address on the route towards the syncer, which is right on a
machine with one network interface; pass it where there are several.  With the syncer on host A
(10.0.0.1) and learners on hosts B (10.0.0.2) and C (10.0.0.3), every host with this repository and the
same settings (the settings must match; the launcher prints them for a run on one machine), and CURVE keys
(a syncer bound to a non-loopback address refuses to start without them unless ``--insecure``): ``keys``
writes them on A; copy ``certs/syncer.key`` and the learner's own ``certs/learner<i>.key_secret`` to each
learner's host (the same paths), and keep ``certs/allowed/`` (the allow-list) on A::

    A$ python -m experiments.async_diloco keys    --keys certs --learners 2
    A$ python -m experiments.async_diloco syncer  --address tcp://0.0.0.0:5555 --advertise 10.0.0.1 --learners 2 --keys certs
    B$ python -m experiments.async_diloco learner --address tcp://10.0.0.1:5555 --advertise 10.0.0.2 --learners 2 --index 0 --keys certs
    C$ python -m experiments.async_diloco learner --address tcp://10.0.0.1:5555 --advertise 10.0.0.3 --learners 2 --index 1 --keys certs

The syncer's port (5555) and each process's transfer server (a free port on its advertised address) must be
reachable between the machines (the same network, no NAT between them); stop the syncer with Ctrl-C once
the learners are done.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PROG = "python -m experiments.async_diloco"
REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "runs" / "async_diloco"
#: Compressors of the outer gradients, by name (built by :func:`make_compressor`).
COMPRESSORS = ("chunktopk", "e3m0", "identity")
#: Codecs of the syncer's replies, by name (built by :func:`make_reply_compressor`).
REPLY_COMPRESSORS = ("none", "bfloat16", "e3m0")


def say(*parts) -> None:
    """Print one progress line, flushed (the launcher and the benchmark read these lines)."""
    print(*parts, flush=True)


def learner_name(index: int) -> str:
    """The name of learner ``index``: ``learner<index>``."""
    return f"learner{index}"


def make_compressor(name: str):
    """The outer gradients' compressor (``axis_name=None``: one learner's, error feedback included).

    ``chunktopk``: SparseLoCo's (64 of every 64 x 64 tile, 2-bit values, decayed error feedback);
    ``e3m0``: 4-bit E3M0 with error feedback; ``identity``: float32, exact.

    Raises:
      ValueError: an unknown name.
    """
    import compjax as cj

    if name == "chunktopk":
        return cj.chunktopk(64, chunk=64, value_bits=2)
    if name == "e3m0":
        return cj.e3m0()
    if name == "identity":
        return cj.identity()
    raise ValueError(f"compressor must be one of {COMPRESSORS}, got {name!r}")


def make_reply_compressor(name: str):
    """The syncer's reply codec (``reply_compressor`` of the syncer and of every learner), or None.

    ``none``: each merge comes back as the fragment's whole float32 values (what lock-step Streaming
    DiLoCo's equivalence needs); ``bfloat16``: the merge's outer update as bfloat16 (2 bytes an entry);
    ``e3m0``: the update as 4-bit E3M0 with the syncer's error feedback (about 4 bits an entry).

    Raises:
      ValueError: an unknown name.
    """
    import jax.numpy as jnp

    import compjax as cj

    if name == "none":
        return None
    if name == "bfloat16":
        return cj.cast(jnp.bfloat16)
    if name == "e3m0":
        return cj.e3m0()
    raise ValueError(f"reply compressor must be one of {REPLY_COMPRESSORS}, got {name!r}")


def load_tokens(args):
    """``(vocab size, train tokens, val tokens)`` of ``--text`` (any text) or of Tiny Shakespeare."""
    from experiments.lm import data

    if args.text:
        text = Path(args.text).read_text()
        vocab = data.Vocab.from_text(text)
        train, val = data.split(vocab.encode(text))
    else:
        vocab, train, val = data.load_dataset()
    return vocab.size, train, val


def build_model(args, vocab: int):
    """``(params, loss_fn)`` of the character transformer of ``--model`` (the same for every process)."""
    from experiments.lm import model

    cfg = model.config(args.model)
    cfg["seq_len"] = max(cfg["seq_len"], args.seq_len)
    params, _, loss_fn = model.build(cfg, vocab=vocab, seed=args.seed)
    return params, loss_fn


def quorum(args) -> int:
    """``min_quorum`` of the run: every learner with ``--lockstep``, else ``--min-quorum`` (default N - 1, at least 2).

    With ``max_staleness`` 0 a contribution that misses its round is refused: a quorum of 1 would refuse
    every other learner's contribution, so the default takes two at least (all of them when N <= 2).
    """
    if args.lockstep:
        return args.learners
    if args.min_quorum is not None:
        return args.min_quorum
    return min(args.learners, max(2, args.learners - 1))


# ----------------------------------------------------------------------------------------------------------------
# The syncer.


def run_syncer(args) -> dict:
    """Serve until SIGTERM / SIGINT; then evaluate the global model's snapshots and write ``syncer.json``."""
    import jax
    import numpy as np
    import optax

    from compjax.decoupled import MultiProcessTransport, Syncer, Transport, delayed_nesterov
    from experiments.lm import data
    from experiments.lm.train import make_evaluator

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, _, val = load_tokens(args)
    params, loss_fn = build_model(args, vocab)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    carried = {"contributions": 0, "replies": 0, "welcomes": [], "released": 0, "control": 0, "tokens": 0.0,
               "pulls": 0}

    def nbytes(arrays) -> int:
        return int(sum(np.asarray(x).nbytes for x in arrays))

    class CountingSyncer(Syncer):
        """The syncer, counting the global values each (re)joining learner is sent."""

        def register(self, name, **kwargs):
            start = super().register(name, **kwargs)
            carried["welcomes"].append([time.time(), name, sum(nbytes(v) for v in start.values)])
            return start

    class Counting(Transport):
        """The syncer's side of the transport, counting the array bytes it moves and its control frames."""

        def __init__(self, inner):
            self.inner, self.last = inner, None

        def attach(self, syncer):
            self.inner.attach(syncer)

        def send(self, contribution):  # pragma: no cover - the learner's side
            self.inner.send(contribution)

        def poll(self, learner, timeout=0.0):  # pragma: no cover - the learner's side
            return self.inner.poll(learner, timeout)

        def receive(self, timeout=0.0):
            last, self.last = self.last, None
            if last is not None and not last["pulled"]:  # refused before its pull: the learner pulls it back
                carried["released"] += last["bytes"]
            incoming = self.inner.receive(timeout)
            if incoming is None:
                return None
            h = incoming.header
            record = {"pulled": False, "bytes": int(sum(
                int(np.prod(s)) * np.dtype(t).itemsize for s, t in zip(h.shapes, h.dtypes)))}
            carried["control"] += control_bytes("header", h)
            self.last = record

            def pull(inner_pull=incoming.pull):
                record["pulled"] = True
                values = inner_pull()  # bounded by the transport's pull_timeout_s
                carried["contributions"] += nbytes(values)
                carried["tokens"] += float(h.tokens)
                carried["pulls"] += 1
                return values

            return type(incoming)(h, pull)

        def reply(self, reply):
            carried["control"] += control_bytes("reply", reply)
            carried["replies"] += nbytes(reply.arrays())  # whole values or the compressed update
            self.inner.reply(reply)

    names = [learner_name(i) for i in range(args.learners)]
    extra = {}
    if "compressor" in inspect.signature(Syncer).parameters:  # a syncer that decodes the learners' payloads
        extra["compressor"] = make_compressor(args.compressor)
    syncer = CountingSyncer(params, learners=names, fragments=args.fragments, **extra,
                            outer=(delayed_nesterov(args.outer_lr, 0.9) if args.outer == "delayed"
                                   else optax.sgd(args.outer_lr, momentum=0.9, nesterov=True)),
                            min_quorum=None if args.quorum_fraction else quorum(args),
                            quorum_fraction=None if args.lockstep else args.quorum_fraction,
                            grace_s=None if args.lockstep else args.grace_s,
                            adaptive_grace=None if args.lockstep else args.adaptive_grace,
                            partial_rounds="mean" if args.lockstep else args.partial_rounds,
                            max_staleness=0 if args.lockstep else args.max_staleness,
                            staleness_decay=args.staleness_decay,
                            heartbeat_timeout_s=None if args.lockstep else args.heartbeat_timeout_s,
                            reply_compressor=make_reply_compressor(args.reply_compressor),
                            max_tokens=args.sync_every * args.batch * args.seq_len)
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else out / "syncer_checkpoint"
    saved = [-1]
    if args.resume:  # the global model, outer state, versions and counters of the latest checkpoint
        saved[0] = syncer.restore(ckpt)
        say(f"syncer resumed from {ckpt} step {saved[0]}: versions {syncer.versions()}")
    elif args.checkpoint_every and ckpt.exists() and any(ckpt.iterdir()):
        raise ValueError(f"{ckpt} holds checkpoints of an earlier syncer: pass --resume to go on from them, or "
                         f"another --checkpoint-dir / --out")

    def checkpoint(why: str) -> None:
        step = sum(syncer.versions())  # merges so far: grows across restarts
        if step > saved[0]:
            syncer.save(ckpt, step)
            saved[0] = step
            say(f"syncer checkpoint {step} ({why}) in {ckpt}")

    syncer.warm_up()  # the merges' compiles now, not inside the first rounds that every learner waits for
    keys = {} if args.keys is None else {"key_file": Path(args.keys) / "syncer.key_secret",
                                         "allowed_keys": Path(args.keys) / "allowed"}
    transport = MultiProcessTransport.for_syncer(args.address, pull_timeout_s=args.pull_timeout_s,
                                                 advertise=args.advertise, insecure=args.insecure, **keys)
    say(f"syncer bound {transport.address}, arrays served from {transport.transfer_address}")
    done = threading.Event()
    server = threading.Thread(target=syncer.serve, args=(Counting(transport), done), daemon=True)
    t0 = time.time()
    server.start()
    snapshots = [(time.time(), [0] * args.fragments, syncer.global_params())]
    while not stop.is_set() and server.is_alive():
        versions = syncer.versions()
        if args.checkpoint_every and sum(versions) >= max(saved[0], 0) + args.checkpoint_every:
            checkpoint(f"every {args.checkpoint_every} merges")
        if min(versions) >= len(snapshots) * args.snapshot_every:  # every fragment merged snapshot_every more
            current = syncer.global_params()
            if syncer.versions() == versions:  # no merge in between: the parameters are those of ``versions``
                snapshots.append((time.time(), versions, current))
                continue
        time.sleep(0.05)
    done.set()
    server.join(timeout=30)
    transport.close()
    if args.checkpoint_every:
        checkpoint("stopped")  # SIGTERM / SIGINT: the state a --resume starts from
    final = syncer.global_params()
    snapshots.append((time.time(), syncer.versions(), final))
    evaluate = make_evaluator(loss_fn)
    windows = data.eval_windows(val, args.eval_batches, 32, args.seq_len)
    curve = [{"t": t, "versions": v, "val_loss": float(evaluate(p, windows))} for t, v, p in snapshots]
    np.savez(out / "global.npz", *[np.asarray(x) for x in jax.tree.leaves(final)])
    result = {"role": "syncer", "address": transport.address, "min_quorum": syncer.min_quorum,
              "learners": list(syncer.learners), "versions": syncer.versions(),
              "merges": [[p, v, list(k)] for p, v, k in syncer.merges], "refused": [list(r) for r in syncer.refused],
              "lost": [[n, t] for n, t in syncer.lost], "last_merged": syncer.last_merged(),
              "val_curve": curve, "val_loss": curve[-1]["val_loss"], "carried": carried, "started": t0,
              "reply_compressor": args.reply_compressor, "reply_bytes_counted": list(syncer.reply_bytes),
              "num_params": int(sum(np.size(x) for x in jax.tree.leaves(params)))}
    (out / "syncer.json").write_text(json.dumps(result, indent=1))
    say(f"syncer done: versions {syncer.versions()}, global validation loss {result['val_loss']:.4f}")
    return result


def control_bytes(kind: str, msg) -> int:
    """The JSON bytes of a ``header`` or ``reply`` control frame of the multi-process transport (estimated).

    The transport's frames are JSON objects; this rebuilds one with the same fields (a transfer id of 19
    digits, a CRC-32 of 10 and an address ``127.0.0.1:PORT``), so it is exact to a few bytes (a few more for a longer address).
    """
    import dataclasses

    if kind == "header":
        h = dataclasses.asdict(msg)
        h["shapes"] = [list(s) for s in msg.shapes]
        h["dtypes"] = list(msg.dtypes)
        frame = {"type": "header", "header": h, "uuid": 10**18, "crc": 2**32 - 1, "address": "127.0.0.1:40000"}
    else:
        frame = {"type": "reply", "learner": msg.learner, "fragment": msg.fragment, "version": msg.version,
                 "accepted": msg.accepted, "reason": msg.reason, "uuid": None}
        arrays = msg.arrays()
        if msg.values is not None or msg.update is not None:
            frame.update(uuid=10**18, crc=2**32 - 1, address="127.0.0.1:40000", shapes=[list(x.shape) for x in arrays],
                         dtypes=[x.dtype.str for x in arrays], update=msg.values is None)
    return len(json.dumps(frame).encode())


# ----------------------------------------------------------------------------------------------------------------
# A learner.


def wait_for(path: str | None, poll_s: float = 0.02) -> None:
    """Block until the file ``path`` exists (None: return at once)."""
    while path and not Path(path).exists():
        time.sleep(poll_s)


def run_learner(args) -> dict:
    """Join the syncer, take ``--steps`` inner steps (or until ``--stop-file``), finish, write ``learner<i>.json``."""
    import jax
    import numpy as np
    import optax

    from compjax.decoupled import Learner, MultiProcessTransport
    from experiments.lm import data

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or learner_name(args.index)
    vocab, train, _ = load_tokens(args)
    params, loss_fn = build_model(args, vocab)
    inner = optax.adamw(args.lr)

    @jax.jit
    def train_step(p, s, windows):
        loss, grads = jax.value_and_grad(loss_fn)(p, windows)
        updates, s = inner.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    tokens_per_step = args.batch * args.seq_len
    batch = lambda step: data.batch_at(train, step, 1, args.batch, args.seq_len, seed=args.seed * 1000 + args.index)[0]
    keys = {} if args.keys is None else {"key_file": Path(args.keys) / f"{name}.key_secret",
                                         "server_key": Path(args.keys) / "syncer.key"}
    cap = args.sync_every * tokens_per_step  # the most tokens one contribution carries (declared in its hello)
    transport = MultiProcessTransport.for_learner(name, args.address, advertise=args.advertise, max_tokens=cap,
                                                  **keys)
    say(f"learner {name}: arrays served from {transport.transfer_address}")
    learner = Learner(name, train_step, params, inner.init(params), transport, sync_every=args.sync_every,
                      fragments=args.fragments, compressor=make_compressor(args.compressor), alpha=args.alpha,
                      wait_for_merge=args.lockstep, late_reply=args.late_reply, reply_timeout_s=args.reply_timeout_s,
                      worker_index=args.index, reply_compressor=make_reply_compressor(args.reply_compressor),
                      max_tokens=cap)
    learner.warm_up(batch(0))  # compile first, then join: the first contribution is fresh
    say(f"learner {name} compiled")
    wait_for(args.join_file)
    start = transport.join(timeout=args.join_timeout_s)
    learner.start_from(start)
    say(f"learner {name} joined at versions {list(start.versions)}")
    if args.ready_file:
        Path(args.ready_file).write_text("ready")
    wait_for(args.go_file)
    losses, sleep_s, pad_s, overruns = [], 0.0, 0.0, 0
    pace = args.step_time_s * (1.0 + args.slowdown)  # each inner step's wall time when paced (0: not paced)
    t0 = time.perf_counter()
    wall0 = time.time()
    for s in range(args.steps):
        if args.stop_file and Path(args.stop_file).exists():
            break
        ts, computed = time.perf_counter(), learner.stats.step_seconds
        losses.append(float(learner.step(batch(s + 1), tokens=tokens_per_step)))
        if pace > 0:  # a learner of a fixed speed: the step padded to `pace` seconds (waits for merges not counted)
            pause = pace - (learner.stats.step_seconds - computed)
            if pause > 0:
                time.sleep(pause)
                pad_s += pause
            else:
                overruns += 1
        elif args.slowdown > 0:  # a straggler: idle for (slowdown x) the step it just took
            pause = args.slowdown * (time.perf_counter() - ts)
            time.sleep(pause)
            sleep_s += pause
        if learner.count % args.log_every == 0:
            say(f"learner {name} step {learner.count} loss {np.mean(losses[-args.log_every:]):.4f}")
    t_loop = time.perf_counter() - t0
    learner.finish()
    wall = time.perf_counter() - t0
    transport.close()
    st = learner.stats
    result = {"role": "learner", "name": name, "index": args.index, "steps": learner.count,
              "tokens": learner.count * tokens_per_step, "wall_s": wall, "loop_s": t_loop, "started": wall0,
              "step_s": st.step_seconds, "wait_s": st.wait_seconds, "sleep_s": sleep_s,
              "pace_s": pace, "pad_s": pad_s, "overruns": overruns,
              "goodput": (st.step_seconds + pad_s) / t_loop if t_loop > 0 else float("nan"),
              "goodput_with_drain": (st.step_seconds + pad_s) / wall if wall > 0 else float("nan"),
              "drain_s": wall - t_loop,
              "tokens_per_s": learner.count * tokens_per_step / t_loop if t_loop > 0 else float("nan"),
              "bytes_sent": list(st.bytes_sent), "sends": list(st.sends), "delays": [list(d) for d in st.delays],
              "refusals": [list(r) for r in st.refusals], "resent": list(st.resent),
              "start_versions": list(start.versions),
              "final_train_loss": float(np.mean(losses[-args.log_every:])) if losses else None}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    say(f"learner {name} done: {learner.count} steps, goodput {result['goodput']:.3f}, "
        f"{result['tokens_per_s']:.0f} tokens/s, {sum(st.bytes_sent)} bytes counted")
    return result


# ----------------------------------------------------------------------------------------------------------------
# The launcher.


def connect_address(address: str, advertise: str | None = None) -> str:
    """The endpoint a learner on the syncer's machine connects to: a wildcard host (``*``, ``0.0.0.0``)
    becomes ``advertise`` (the syncer's advertised address) or 127.0.0.1."""
    head, port = address.rsplit(":", 1)
    if head in ("tcp://*", "tcp://0.0.0.0"):
        return f"tcp://{advertise or '127.0.0.1'}:{port}"
    return address


def role_args(args, role: str, **extra) -> list[str]:
    """The command-line arguments of one role's process, with the run's settings.

    The syncer gets ``--address`` and ``--advertise`` as given; a learner connects to the syncer's
    address (:func:`connect_address`) and advertises what the route towards it gives.
    """
    address = args.address if role == "syncer" else connect_address(args.address, args.advertise)
    a = [role, "--address", address, "--learners", str(args.learners), "--steps", str(args.steps),
         "--sync-every", str(args.sync_every), "--fragments", str(args.fragments), "--compressor", args.compressor,
         "--model", args.model, "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
         "--outer-lr", str(args.outer_lr), "--grace-s", str(args.grace_s), "--max-staleness", str(args.max_staleness),
         "--staleness-decay", str(args.staleness_decay), "--alpha", str(args.alpha), "--late-reply", args.late_reply,
         "--heartbeat-timeout-s", str(args.heartbeat_timeout_s), "--seed", str(args.seed), "--out", str(args.out),
         "--eval-batches", str(args.eval_batches), "--snapshot-every", str(args.snapshot_every),
         "--log-every", str(args.log_every), "--pull-timeout-s", str(args.pull_timeout_s),
         "--reply-compressor", args.reply_compressor, "--partial-rounds", args.partial_rounds,
         "--outer", args.outer, "--step-time-s", str(args.step_time_s)]
    if args.min_quorum is not None:
        a += ["--min-quorum", str(args.min_quorum)]
    if args.quorum_fraction is not None:
        a += ["--quorum-fraction", str(args.quorum_fraction)]
    if args.lockstep:
        a.append("--lockstep")
    if args.text:
        a += ["--text", str(args.text)]
    if role == "syncer" and args.advertise:
        a += ["--advertise", args.advertise]
    if args.keys:
        a += ["--keys", str(args.keys)]
    if role == "syncer" and args.insecure:
        a.append("--insecure")
    for k, v in extra.items():
        a += [f"--{k.replace('_', '-')}", str(v)]
    return a


def child_env() -> dict:
    """The environment of a role's process: one CPU device (``XLA_FLAGS`` without an inherited device count, its
    other flags kept), the repository importable."""
    env = dict(os.environ)
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def free_address() -> str:
    """``tcp://127.0.0.1:PORT`` with a port that is free now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def write_keys(folder: Path, names: list[str]) -> None:
    """CURVE certificates (``zmq.auth.create_certificates``): the syncer's and each learner's key pair in ``folder``,
    the learners' public halves again in ``folder/allowed`` (the syncer's allow-list).  Copy to each learner's
    machine only its own ``NAME.key_secret`` and ``syncer.key``."""
    import shutil

    import zmq.auth

    (folder / "allowed").mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(folder, "syncer")
    for name in names:
        public, _ = zmq.auth.create_certificates(folder, name)
        shutil.copy(public, folder / "allowed")
    say(f"CURVE certificates of the syncer and {len(names)} learners in {folder}; the allow-list: {folder / 'allowed'}")


def launch(args) -> int:
    """Start the syncer and the learners here, print the per-role commands, wait for the learners, stop the syncer."""
    if args.address is None:
        args.address = free_address()
    args.out = str(Path(args.out or RUNS / time.strftime("%Y%m%d-%H%M%S")).resolve())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "experiments.async_diloco"]
    say(f"The same run on several terminals (or hosts, see {PROG} --help), the syncer first:")
    shown = ["python", "-m", "experiments.async_diloco"]
    say("  " + shlex.join([*shown, *role_args(args, "syncer")]))
    for i in range(args.learners):
        say("  " + shlex.join([*shown, *role_args(args, "learner", index=i)]))
    say(f"Every learner is given the syncer's address ({connect_address(args.address, args.advertise)}); "
        f"stop the syncer with Ctrl-C when they are done.")
    say("On several machines: keys --keys DIR on host A, the syncer on A with --address tcp://0.0.0.0:PORT --advertise "
        "A_IP --keys DIR, each learner on its host with --address tcp://A_IP:PORT --advertise ITS_IP --keys DIR "
        "(see --help).")
    say(f"Starting them here; results in {args.out}")
    logs = Path(args.out)
    env = child_env()
    procs = {}
    with open(logs / "syncer.log", "w") as f:
        procs["syncer"] = subprocess.Popen([*py, *role_args(args, "syncer")], cwd=REPO, env=env, stdout=f,
                                           stderr=subprocess.STDOUT)
    for i in range(args.learners):
        with open(logs / f"{learner_name(i)}.log", "w") as f:
            procs[learner_name(i)] = subprocess.Popen([*py, *role_args(args, "learner", index=i)], cwd=REPO,
                                                      env=env, stdout=f, stderr=subprocess.STDOUT)
    failed = []
    try:
        for i in range(args.learners):
            rc = procs[learner_name(i)].wait()
            if rc != 0:
                failed.append(learner_name(i))
    finally:
        procs["syncer"].send_signal(signal.SIGTERM)
        if procs["syncer"].wait(timeout=300) != 0:
            failed.append("syncer")
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    if failed:
        say(f"failed: {failed} (see their logs in {args.out})")
        return 1
    syncer = json.loads((logs / "syncer.json").read_text())
    say(f"global model: validation loss {syncer['val_loss']:.4f} after versions {syncer['versions']}")
    for i in range(args.learners):
        r = json.loads((logs / f"{learner_name(i)}.json").read_text())
        say(f"  {r['name']}: {r['steps']} steps, goodput {r['goodput']:.1%}, {r['tokens_per_s']:,.0f} tokens/s, "
            f"{sum(r['bytes_sent']):,} bytes counted, {len(r['refusals'])} refusals")
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line (shared by the launcher and the two roles)."""
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", choices=["launch", "syncer", "learner", "keys"], default="launch",
                    help="launch (default): the syncer and every learner here; syncer or learner: one role; "
                         "keys: write CURVE certificates for the syncer and --learners learners to --keys")
    ap.add_argument("--keys", default=None,
                    help="a folder of ZeroMQ CURVE certificates (written by the keys role): the syncer reads "
                         "syncer.key_secret and the allow-list allowed/NAME.key, a learner NAME.key_secret and "
                         "syncer.key; without it the syncer binds only a loopback address unless --insecure")
    ap.add_argument("--insecure", action="store_true",
                    help="(syncer) bind a non-loopback address without keys: anyone who reaches it may contribute")
    ap.add_argument("--learners", type=int, default=4, help="N, the learners the syncer expects (default 4)")
    ap.add_argument("--address", default=None,
                    help="the syncer's endpoint tcp://HOST:PORT: the syncer binds it (HOST an IPv4 address of its "
                         "machine, or 0.0.0.0 / * for every interface), a learner connects to it (HOST the syncer's "
                         "IPv4 address or host name); default for the launcher: tcp://127.0.0.1:<a free port>")
    ap.add_argument("--advertise", default=None,
                    help="this process's IPv4 address as its peers reach it: its transfer server binds it and the "
                         "peers pull arrays from it (default: the syncer the host it binds, or its address on the "
                         "default route for 0.0.0.0; a learner its address on the route towards the syncer)")
    ap.add_argument("--steps", type=int, default=600, help="inner steps per learner")
    ap.add_argument("--sync-every", type=int, default=100, help="H: inner steps between two sends of a fragment")
    ap.add_argument("--fragments", type=int, default=4, help="Streaming DiLoCo's fragments (1: plain DiLoCo)")
    ap.add_argument("--compressor", choices=COMPRESSORS, default="chunktopk")
    ap.add_argument("--reply-compressor", choices=REPLY_COMPRESSORS, default="none",
                    help="the syncer's replies: whole float32 values (none) or each merge's update as bfloat16 or "
                         "4-bit e3m0 with the syncer's error feedback (every learner stays bit-identical to the syncer)")
    ap.add_argument("--model", default="tiny", help="the character transformer's size (experiments.lm.model)")
    ap.add_argument("--batch", type=int, default=16, help="windows per learner per inner step")
    ap.add_argument("--seq-len", type=int, default=64, help="characters per window")
    ap.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's learning rate")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="the outer Nesterov SGD's learning rate")
    ap.add_argument("--outer", choices=("nesterov", "delayed"), default="nesterov",
                    help="the syncer's outer optimizer: Nesterov SGD (momentum 0.9), or Delayed Nesterov "
                         "(compjax.decoupled.delayed_nesterov: the momentum steps once per full round's share of "
                         "tokens; the same as nesterov when every round is full)")
    ap.add_argument("--min-quorum", type=int, default=None, help="contributions that merge a round (default N - 1, at least 2)")
    ap.add_argument("--quorum-fraction", type=float, default=None,
                    help="instead of --min-quorum: the quorum is this fraction of the live learners (follows joins, "
                         "losses and leaves)")
    ap.add_argument("--grace-s", type=float, default=2.0,
                    help="seconds a round waits for its quorum (a fraction of the time between two sends of a fragment)")
    ap.add_argument("--adaptive-grace", type=float, default=None,
                    help="c >= 1: the grace window is min(--grace-s, c x the 90th percentile of recent rounds' "
                         "arrival spreads) (default: the fixed --grace-s)")
    ap.add_argument("--partial-rounds", choices=("mean", "share"), default="mean",
                    help="a round merged by part of the live learners moves the model as far as a full one (mean) "
                         "or by its share of their tokens (share); unused with --lockstep")
    ap.add_argument("--max-staleness", type=int, default=0,
                    help="the stalest contribution accepted, in merges (0: one that missed its round is refused)")
    ap.add_argument("--staleness-decay", type=float, default=0.0, help="a stale contribution weighs exp(-decay tau)")
    ap.add_argument("--alpha", type=float, default=0.5, help="weight of the local parameters when a merge comes back")
    ap.add_argument("--late-reply", choices=("defer", "wait", "drop"), default="wait",
                    help="a fragment due again before its merge came back: send it once the merge is in and train "
                         "on (defer), block for the merge (wait), or defer and give the send up once "
                         "--reply-timeout-s late (drop: learners train on while the syncer is down, and rejoin when "
                         "it is back); unused with --lockstep")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=5.0, help="silence after which a learner is lost")
    ap.add_argument("--lockstep", action="store_true",
                    help="lock-step Streaming DiLoCo: quorum = all, no grace limit, learners wait for each merge")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default=None, help="train on this text file instead of Tiny Shakespeare (no checksum)")
    ap.add_argument("--out", default=None, help="the run's folder (default runs/async_diloco/<time>)")
    ap.add_argument("--eval-batches", type=int, default=8, help="validation batches of 32 windows")
    ap.add_argument("--snapshot-every", type=int, default=1,
                    help="the syncer keeps the global model every this many merges of every fragment (evaluated at the end)")
    ap.add_argument("--log-every", type=int, default=50, help="a learner's progress line every this many steps")
    ap.add_argument("--index", type=int, default=0, help="(learner) its index: name learner<index>, its data")
    ap.add_argument("--name", default=None, help="(learner) its name, default learner<index>")
    ap.add_argument("--checkpoint-every", type=int, default=10,
                    help="(syncer) write a checkpoint every this many merges and when stopped (0: never)")
    ap.add_argument("--checkpoint-dir", default=None, help="(syncer) where (default <out>/syncer_checkpoint)")
    ap.add_argument("--resume", action="store_true",
                    help="(syncer) start from the latest checkpoint of --checkpoint-dir (a restarted syncer)")
    ap.add_argument("--pull-timeout-s", type=float, default=10.0,
                    help="(syncer) the longest wait for one contribution's arrays (a longer one is refused)")
    ap.add_argument("--reply-timeout-s", type=float, default=300.0, help="(learner) the longest wait for one reply")
    ap.add_argument("--join-timeout-s", type=float, default=300.0, help="(learner) the longest wait for the welcome")
    ap.add_argument("--step-time-s", type=float, default=0.0,
                    help="(learner) pace: pad every inner step to this many seconds of wall time, (1 + --slowdown) "
                         "times that for a straggler (a learner of a fixed speed, as on a machine of its own; steps "
                         "whose compute takes longer are counted as overruns; 0: not paced)")
    ap.add_argument("--slowdown", type=float, default=0.0,
                    help="(learner) a straggler: idle this many times each step's duration after it (1: 2x slower); "
                         "with --step-time-s, its steps are paced to (1 + slowdown) x that")
    for f in ("ready-file", "go-file", "join-file", "stop-file"):
        ap.add_argument(f"--{f}", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.learners < 1 or args.steps < 1 or args.sync_every < 1 or args.fragments < 1:
        raise ValueError("--learners, --steps, --sync-every and --fragments must be >= 1, got "
                         f"{args.learners}, {args.steps}, {args.sync_every}, {args.fragments}")
    if not (args.step_time_s >= 0 and args.slowdown >= 0):
        raise ValueError(f"--step-time-s and --slowdown must be >= 0, got {args.step_time_s} and {args.slowdown}")
    if args.min_quorum is not None and not 1 <= args.min_quorum <= args.learners:
        raise ValueError(f"--min-quorum must be in [1, --learners = {args.learners}], got {args.min_quorum}")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
    if args.role == "keys":
        if args.keys is None:
            raise ValueError("--keys is needed for the keys role: the folder the certificates go to")
        write_keys(Path(args.keys), [args.name or learner_name(i) for i in range(args.learners)])
        return 0
    if args.role == "launch":
        return launch(args)
    if args.address is None:
        raise ValueError("--address is needed for a single role (the syncer's endpoint, tcp://HOST:PORT)")
    args.out = args.out or str(RUNS / "roles")
    if args.role == "syncer":
        run_syncer(args)
    else:
        run_learner(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
