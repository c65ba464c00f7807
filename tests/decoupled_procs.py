"""A syncer or a learner of decoupled DiLoCo as its own process, for the multi-process tests.

    python -m tests.decoupled_procs syncer  CONFIG_JSON
    python -m tests.decoupled_procs learner CONFIG_JSON
    python -m tests.decoupled_procs bad     CONFIG_JSON     (a client that sends bad contributions)
    python -m tests.decoupled_procs sharded_syncer  CONFIG_JSON   (sharded learners' syncer, per shard)
    python -m tests.decoupled_procs sharded_learner CONFIG_JSON   (a learner on a 4-device fsdp mesh)

CONFIG_JSON is a JSON object (see ``main``); its ``runs`` list holds one entry per run, each with its own
address, run one after the other by the same processes (one start-up and import for several runs).  The
model and data are those of tests/test_diloco.py (quadratic losses, SGD inner steps).  Every process prints
progress lines that the tests wait for (flushed) and writes its results as JSON / .npz under ``out``.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax as cj
from compjax.decoupled import Contribution, Header, Learner, MultiProcessTransport, Syncer, multiprocess
from tests.test_diloco import init_params, targets

LR = 0.1


def say(*parts) -> None:
    print(*parts, flush=True)


def compressor(name):
    if name == "identity":
        return None  # the learner's default: float32, exact
    return cj.chunktopk(2, chunk=4, skip_nonfinite=False)


def reply_compressor(name):
    """The syncer's reply codec of a run: None (whole float32 values) or a compressor's name."""
    if name is None:
        return None
    return cj.cast(jnp.bfloat16) if name == "bfloat16" else cj.e3m0()


def save_params(path: Path, tree) -> None:
    np.savez(path, *[np.asarray(x) for x in jax.tree.leaves(tree)])


def run_syncer(run: dict, out: Path, stop: threading.Event, last: bool) -> None:
    """Serve one run until ``stop`` is set or, when another run follows, every fragment reached
    ``run["versions"]`` merges and ``linger_s`` passed (time for the learners to pull the last replies)."""
    syncer = Syncer(init_params(), learners=run["learners"], fragments=run["P"],
                    compressor=compressor(run.get("comp", "identity")), min_quorum=run.get("min_quorum"),
                    grace_s=run.get("grace_s"), max_staleness=run.get("max_staleness", 0),
                    heartbeat_timeout_s=run.get("heartbeat_timeout_s"),
                    reply_compressor=reply_compressor(run.get("reply")))
    ckpt = run.get("checkpoint")
    if run.get("restore_from"):
        say(f"restored step {syncer.restore(run['restore_from'])}")
        save_params(out / f"restored_{run['name']}.npz", syncer.global_params())
    transport = MultiProcessTransport.for_syncer(run["address"], advertise=run.get("advertise"))
    say(f"syncer bound {transport.address} transfer {transport.transfer_address}")
    done = threading.Event()
    server = threading.Thread(target=syncer.serve, args=(transport, done), daemon=True)
    server.start()
    saved = len(syncer.merges)
    last_step = sum(syncer.versions()) if run.get("restore_from") else -1  # the newest checkpoint's step
    target, reached = run.get("versions"), None
    while not stop.is_set() and server.is_alive():
        if ckpt and len(syncer.merges) > saved:
            saved = len(syncer.merges)
            step = sum(syncer.versions())  # merges made, restored ones included: grows across restarts
            # A merge is listed in ``merges`` before its fragment's version moves on (read here without the
            # syncer's lock): the step may not have grown yet, and a checkpoint's step must (as the launcher's).
            if step > last_step:
                syncer.save(ckpt, step)  # the state of at least ``step`` merges, taken under the syncer's lock
                say(f"saved step {step}")
                for k in range(max(last_step, 0) + 1, step + 1):  # the step can grow by several at once
                    say(f"saved at least {k} merges")
                last_step = step
        if reached is None and target is not None and min(syncer.versions()) >= target:
            reached = time.monotonic()
            say(f"syncer reached {target} {run['name']}")
        if not last and reached is not None and time.monotonic() - reached > run.get("linger_s", 5.0):
            break  # the last replies had time to be pulled: on to the next run
        time.sleep(0.02)
    done.set()
    server.join(timeout=30)
    transport.close()
    save_params(out / f"global_{run['name']}.npz", syncer.global_params())
    save_params(out / f"fragments_{run['name']}.npz", [syncer.fragment_values(p) for p in range(syncer.fragments)])
    summary = {"merges": [[p, v, list(k)] for p, v, k in syncer.merges], "refused": syncer.refused,
               "lost": [name for name, _ in syncer.lost], "versions": syncer.versions(),
               "learners": list(syncer.learners), "last_merged": syncer.last_merged()}
    (out / f"syncer_{run['name']}.json").write_text(json.dumps(summary))
    say(f"syncer done {run['name']}")


def run_learner(run: dict, out: Path) -> None:
    """Join the syncer, train ``steps`` inner steps on worker ``index``'s data (or until the stop file), finish."""
    name, index = run["name_self"], run["index"]
    inner = optax.sgd(LR)

    @jax.jit
    def train_step(params, inner_state, c):  # the loss 0.5 |θ - c|^2 of test_diloco: gradient θ - c
        grads = jax.tree.map(lambda x, y: x - y, params, c)
        updates, inner_state = inner.update(grads, inner_state, params)
        return optax.apply_updates(params, updates), inner_state, 0.0

    params0 = init_params()
    transport = MultiProcessTransport.for_learner(name, run["address"], advertise=run.get("advertise"))
    say(f"learner {name} transfer {transport.transfer_address}")  # connected; joins after the warm-up
    lrn = Learner(name, train_step, params0, inner.init(params0), transport, sync_every=run["H"],
                  fragments=run["P"], compressor=compressor(run["comp"]), wait_for_merge=run.get("wait", True),
                  reply_timeout_s=run.get("reply_timeout_s", 120), worker_index=index,
                  reply_compressor=reply_compressor(run.get("reply")))
    data = targets(run["steps"], run["n"])
    lrn.warm_up(jax.tree.map(lambda x: x[index], data[0]))  # compile first, then join: the first send is fresh
    start = transport.join(timeout=run.get("join_timeout_s", 120))
    lrn.start_from(start)
    say(f"learner {name} joined at versions {list(start.versions)}")
    stop_file = Path(run["stop_file"]) if run.get("stop_file") else None
    for s in range(run["steps"]):
        if stop_file is not None and stop_file.exists():
            break
        lrn.step(jax.tree.map(lambda x: x[index], data[s % len(data)]), tokens=8)
        if s % 10 == 0 or s == run["steps"] - 1:
            say(f"learner {name} step {lrn.count} versions {lrn.versions()}")
        time.sleep(run.get("step_sleep", 0.0))
    lrn.finish()
    transport.close()
    save_params(out / f"learner_{run['name']}_{name}.npz", lrn.params)
    save_params(out / f"anchor_{run['name']}_{name}.npz", [lrn.anchor(p) for p in range(lrn.fragments)])
    stats = {"sends": lrn.stats.sends, "refusals": lrn.stats.refusals, "delays": lrn.stats.delays,
             "count": lrn.count, "start_versions": list(start.versions)}
    (out / f"learner_{run['name']}_{name}.json").write_text(json.dumps(stats))
    say(f"learner {name} done {run['name']}")


def run_bad(run: dict, out: Path) -> None:
    """Join as learner ``name_self``, send one good contribution (merged: min_quorum 1), then each bad one of
    ``run["cases"]``; write the syncer's answers, the merged values and the offers released."""
    name = run["name_self"]
    transport = MultiProcessTransport.for_learner(name, run["address"])
    start = transport.join(timeout=120)
    good = start.values[0]
    answers = []
    merged = None
    for seq, case in enumerate(["good", *run["cases"]], start=1):
        # The payload of the syncer's default compressor (cj.identity): the leaves in one float32 buffer.
        values = [np.concatenate([np.ravel(np.array(v, np.float32) * 0.01) for v in good])]
        fields = {"learner": name, "fragment": 0, "base_version": start.versions[0] + (case != "good"),
                  "tokens": 8.0, "step": 1, "shapes": tuple(v.shape for v in values),
                  "dtypes": tuple(v.dtype.str for v in values), "payload_bytes": sum(v.nbytes for v in values),
                  "seq": seq}
        sender = transport
        if case == "nonfinite":
            values[0][0] = np.nan
        elif case == "wrong_fragment":
            fields["fragment"] = 7
        elif case == "wrong_shape":
            values[0] = values[0].reshape(1, -1)
            fields["shapes"] = tuple(v.shape for v in values)
        elif case == "wrong_dtype":
            values[0] = values[0].astype(np.float16)
            fields["dtypes"] = tuple(v.dtype.str for v in values)
        elif case == "too_large":  # 4 TiB declared: refused before a byte is allocated (the arrays are small)
            fields["shapes"] = ((1 << 40,), *fields["shapes"][1:])
        elif case == "stale":
            fields["base_version"] = start.versions[0]  # the good contribution made it one version old
        elif case == "bad_tokens":
            fields["tokens"] = float("inf")
        elif case == "unknown":  # a process that never said hello: no reply, its offer released
            sender = MultiProcessTransport.for_learner("intruder", run["address"])
            fields["learner"] = "intruder"
        sender.send(Contribution(Header(**fields), tuple(values)))
        if case == "unknown":
            deadline = time.monotonic() + 60
            while sender.released < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            answers.append([case, ["released", sender.released]])
            sender.close()
        else:
            reply = transport.poll(name, timeout=60)
            answers.append([case, None if reply is None else [reply.accepted, reply.reason]])
            if case == "good" and reply is not None:
                merged = reply.values
        say(f"bad {case}: {answers[-1][1]}")
    if merged is not None:
        np.savez(out / "merged_by_good.npz", *merged)
    (out / f"bad_{name}.json").write_text(json.dumps({"answers": answers, "released": transport.released}))
    transport.close()
    say(f"bad done {name}")


def _sharded_setup(run: dict):
    """The model, data, this process's 1 x fast mesh and the fsdp specs of tests/test_decoupled_sharded.py."""
    from jax.sharding import Mesh

    from compjax import parallel
    from tests.test_decoupled_sharded import batches, mlp

    rng = np.random.default_rng(0)
    params0 = mlp(rng)
    data = batches(rng, run["steps"], 8 * run["n"] * run["fast"])
    mesh = Mesh(np.array(jax.local_devices()[:run["fast"]]).reshape(1, run["fast"]), ("data", "fast"))
    return params0, data, mesh, parallel.fsdp_specs(params0, mesh, min_size=1)


def run_sharded_syncer(run: dict, out: Path, stop: threading.Event) -> None:
    """Merge shard by shard until every shard reached ``versions`` merges and ``linger_s`` passed."""
    from compjax import parallel
    from compjax.decoupled import ShardedSyncer, ShardLayout

    params0, _, mesh, specs = _sharded_setup(run)
    layout = ShardLayout.of(parallel.replicate(params0, mesh, specs=specs))  # the learners' layout
    syncer = ShardedSyncer(jax.tree.map(lambda x: x[None], params0), layout, learners=run["learners"])
    transport = MultiProcessTransport.for_syncer(run["address"])
    say(f"syncer bound {transport.address}")
    done = threading.Event()
    server = threading.Thread(target=syncer.serve, args=(transport, done), daemon=True)
    server.start()
    reached = None
    while not stop.is_set() and server.is_alive():
        if reached is None and min(syncer.versions()) >= run["versions"]:
            reached = time.monotonic()
            say(f"syncer reached {run['versions']}")
        if reached is not None and time.monotonic() - reached > run.get("linger_s", 5.0):
            break
        time.sleep(0.02)
    done.set()
    server.join(timeout=30)
    transport.close()
    save_params(out / "sharded_global.npz", syncer.global_params())
    (out / "sharded_syncer.json").write_text(json.dumps({
        "versions": syncer.versions(), "merges": [[list(k) for _, _, k in sh.merges] for sh in syncer.shards],
        "refused": [sh.refused for sh in syncer.shards]}))
    say("syncer done sharded")


def run_sharded_learner(run: dict, out: Path) -> None:
    """Join, train ``steps`` steps on rows ``index`` of each global batch on this process's fsdp mesh, finish."""
    from compjax import parallel
    from compjax.decoupled import ShardedLearner

    name, index = run["name_self"], run["index"]
    params0, data, mesh, specs = _sharded_setup(run)
    inner = optax.sgd(LR)
    step = parallel.data_parallel_step(tests_sharded_loss(), inner, mesh, specs=specs, independent=True)
    transport = MultiProcessTransport.for_learner(name, run["address"])
    lrn = ShardedLearner(name, step, parallel.replicate(params0, mesh, specs=specs),
                         parallel.init_worker_state(inner, params0, mesh, specs=specs), transport,
                         sync_every=run["H"], wait_for_merge=True, reply_timeout_s=120)
    rows = len(data[0][0]) // run["n"]
    batch = lambda x, y: parallel.shard_batch((x[index * rows:(index + 1) * rows], y[index * rows:(index + 1) * rows]),
                                              mesh)
    jax.block_until_ready(step(lrn.params, lrn.inner_state, batch(*data[0])))  # compile before joining
    lrn.start_from(transport.join(timeout=120))
    say(f"learner {name} joined")
    whole = []  # per step: leaves whose per-device shard is the whole leaf
    for x, y in data:
        lrn.step(batch(x, y), tokens=rows)
        whole += [str(p) for p, v in jax.tree_util.tree_leaves_with_path(lrn.params)
                  if v.sharding.shard_shape(v.shape) == v.shape]
        whole += [f"anchor {s}" for s, pieces in enumerate(lrn._anchor) for a in pieces if len(a.devices()) != 1]
    lrn.finish()
    transport.close()
    save_params(out / f"sharded_learner_{name}.npz", lrn.params)
    (out / f"sharded_learner_{name}.json").write_text(json.dumps({
        "whole": whole, "sends": lrn.stats.sends, "bytes_sent": lrn.stats.bytes_sent, "refusals": lrn.stats.refusals,
        "devices": len(jax.local_devices())}))
    say(f"learner {name} done sharded")


def tests_sharded_loss():
    from tests.test_decoupled_sharded import mlp_loss

    return mlp_loss


def log_pulls() -> None:
    """Print the transfer address of every pull this process makes (``pulled from HOST:PORT``)."""
    real = multiprocess._transfer

    def transfer(address, uuid, specs):
        say(f"pulled from {address}")
        return real(address, uuid, specs)

    multiprocess._transfer = transfer


def main() -> None:
    role, config = sys.argv[1], json.loads(sys.argv[2])
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
    if config.get("log_pulls"):
        log_pulls()
    out = Path(config["out"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for k, run in enumerate(config["runs"]):
        run = {**config, **run}
        if role == "syncer":
            run_syncer(run, out, stop, last=k == len(config["runs"]) - 1)
        elif role == "learner":
            run_learner(run, out)
        elif role == "sharded_syncer":
            run_sharded_syncer(run, out, stop)
        elif role == "sharded_learner":
            run_sharded_learner(run, out)
        else:
            run_bad(run, out)
        if stop.is_set():
            break
    say(f"{role} exits")


if __name__ == "__main__":
    main()
