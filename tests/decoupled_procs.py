"""A syncer or a learner of decoupled DiLoCo as its own process, for the multi-process tests.

    python -m tests.decoupled_procs syncer  CONFIG_JSON
    python -m tests.decoupled_procs learner CONFIG_JSON
    python -m tests.decoupled_procs bad     CONFIG_JSON     (a client that sends bad contributions)

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
import numpy as np
import optax

import compjax as cj
from compjax.decoupled import Contribution, Header, Learner, MultiProcessTransport, Syncer
from tests.test_diloco import init_params, targets

LR = 0.1


def say(*parts) -> None:
    print(*parts, flush=True)


def compressor(name):
    if name == "identity":
        return None  # the learner's default: float32, exact
    return cj.chunktopk(2, chunk=4, skip_nonfinite=False)


def save_params(path: Path, tree) -> None:
    np.savez(path, *[np.asarray(x) for x in jax.tree.leaves(tree)])


def run_syncer(run: dict, out: Path, stop: threading.Event) -> None:
    """Serve one run until every fragment reached ``run["versions"]`` merges (if given) or ``stop`` is set."""
    syncer = Syncer(init_params(), learners=run["learners"], fragments=run["P"], min_quorum=run.get("min_quorum"),
                    grace_s=run.get("grace_s"), max_staleness=run.get("max_staleness", 0),
                    heartbeat_timeout_s=run.get("heartbeat_timeout_s"))
    ckpt = run.get("checkpoint")
    if ckpt and run.get("restore"):
        say(f"restored step {syncer.restore(ckpt)}")
        save_params(out / f"restored_{run['name']}.npz", syncer.global_params())
    transport = MultiProcessTransport.for_syncer(run["address"])
    say(f"syncer bound {transport.address}")
    done = threading.Event()
    server = threading.Thread(target=syncer.serve, args=(transport, done), daemon=True)
    server.start()
    saved = len(syncer.merges)
    target, reached = run.get("versions"), None
    while not stop.is_set() and server.is_alive():
        if ckpt and len(syncer.merges) > saved:
            saved = len(syncer.merges)
            syncer.save(ckpt, saved)  # the state of at least ``saved`` merges, under the syncer's lock
            say(f"saved step {saved}")
        if reached is None and target is not None and min(syncer.versions()) >= target:
            reached = time.monotonic()
            say(f"syncer reached {target} {run['name']}")
        if reached is not None and time.monotonic() - reached > run.get("linger_s", 5.0):
            break  # the last replies had time to be pulled: on to the next run
        time.sleep(0.02)
    done.set()
    server.join(timeout=30)
    transport.close()
    save_params(out / f"global_{run['name']}.npz", syncer.global_params())
    summary = {"merges": [[p, v, list(k)] for p, v, k in syncer.merges], "refused": syncer.refused,
               "lost": [name for name, _ in syncer.lost], "versions": syncer.versions(),
               "learners": list(syncer.learners), "last_merged": syncer.last_merged()}
    (out / f"syncer_{run['name']}.json").write_text(json.dumps(summary))
    say(f"syncer done {run['name']}")


def run_learner(run: dict, out: Path) -> None:
    """Join the syncer, train ``steps`` inner steps on worker ``index``'s data (or until the stop file), finish."""
    name, index = run["name_self"], run["index"]
    transport = MultiProcessTransport.for_learner(name, run["address"])
    start = transport.join(timeout=run.get("join_timeout_s", 120))
    say(f"learner {name} joined at versions {list(start.versions)}")
    inner = optax.sgd(LR)

    @jax.jit
    def train_step(params, inner_state, c):  # the loss 0.5 |θ - c|^2 of test_diloco: gradient θ - c
        grads = jax.tree.map(lambda x, y: x - y, params, c)
        updates, inner_state = inner.update(grads, inner_state, params)
        return optax.apply_updates(params, updates), inner_state, 0.0

    params0 = init_params()
    lrn = Learner(name, train_step, params0, inner.init(params0), transport, sync_every=run["H"],
                  fragments=run["P"], compressor=compressor(run["comp"]), wait_for_merge=run.get("wait", True),
                  reply_timeout_s=run.get("reply_timeout_s", 120), worker_index=index, start=start)
    data = targets(run["steps"], run["n"])
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
    stats = {"sends": lrn.stats.sends, "refusals": lrn.stats.refusals, "delays": lrn.stats.delays,
             "count": lrn.count, "start_versions": list(start.versions)}
    (out / f"learner_{run['name']}_{name}.json").write_text(json.dumps(stats))
    say(f"learner {name} done {run['name']}")


def run_bad(run: dict, out: Path) -> None:
    """Join as a known learner and send each bad contribution of ``run["cases"]``; print the syncer's answers."""
    name = run["name_self"]
    transport = MultiProcessTransport.for_learner(name, run["address"])
    start = transport.join(timeout=120)
    good = start.values[0]
    answers = []
    for case in run["cases"]:
        values = [np.array(v, np.float32) for v in good]
        fields = {"learner": name, "fragment": 0, "base_version": start.versions[0], "tokens": 8.0, "step": 1,
                  "shapes": tuple(v.shape for v in values), "dtypes": tuple(v.dtype.str for v in values),
                  "payload_bytes": sum(v.nbytes for v in values)}
        if case == "nonfinite":
            values[0][0] = np.nan
        elif case == "wrong_fragment":
            fields["fragment"] = 7
        elif case == "wrong_shape":
            values[0] = values[0].reshape(-1)
            fields["shapes"] = tuple(v.shape for v in values)
        elif case == "wrong_dtype":
            values[0] = values[0].astype(np.float64)
            fields["dtypes"] = tuple(v.dtype.str for v in values)
        elif case == "too_large":
            values.append(np.zeros(1 << 16, np.float32))
            fields["shapes"] = tuple(v.shape for v in values)
            fields["dtypes"] = tuple(v.dtype.str for v in values)
        elif case == "stale":
            fields["base_version"] = -1
        elif case == "bad_tokens":
            fields["tokens"] = float("inf")
        transport.send(Contribution(Header(**fields), tuple(values)))
        reply = transport.poll(name, timeout=60)
        answers.append([case, None if reply is None else [reply.accepted, reply.reason]])
        say(f"bad {case}: {answers[-1][1]}")
    transport.close()
    (out / f"bad_{name}.json").write_text(json.dumps(answers))
    say(f"bad done {name}")


def main() -> None:
    role, config = sys.argv[1], json.loads(sys.argv[2])
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
    out = Path(config["out"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for run in config["runs"]:
        run = {**config, **run}
        if role == "syncer":
            run_syncer(run, out, stop)
        elif role == "learner":
            run_learner(run, out)
        else:
            run_bad(run, out)
        if stop.is_set():
            break
    say(f"{role} exits")


if __name__ == "__main__":
    main()
