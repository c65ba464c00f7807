"""Several processes through jax.distributed (gloo on localhost), 2-D meshes, and a lost peer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax as cj
from compjax import parallel
from compjax.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parent.parent


def _env(cache: Path | None = None):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # each command sets its own device count
    if cache is not None:  # a persistent compilation cache: a restarted run compiles nothing
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def launch(processes: int, devices: int, log_dir: Path, *argv: str, module: str = "experiments.train",
           wait: bool = True, cache: Path | None = None):
    cmd = [sys.executable, "-m", "experiments.launch", "--processes", str(processes), "--devices-per-process",
           str(devices), "--module", module, "--log-dir", str(log_dir), "--", *argv]
    if wait:
        return subprocess.run(cmd, cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=300,
                              check=False)
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_two_processes_match_one_process(tmp_path):
    """2 processes x 2 CPU devices (gloo) == 1 process x 4 devices after 20 steps, for three compressors."""
    two = launch(2, 2, tmp_path / "logs", "--out", str(tmp_path / "2x2"), module="experiments.distributed_check")
    assert two.returncode == 0, two.stdout + (tmp_path / "logs" / "process_1.log").read_text()
    assert "process 1 of 2: 4 workers" in (tmp_path / "logs" / "process_1.log").read_text()
    env = {**_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    subprocess.run([sys.executable, "-m", "experiments.distributed_check", "--out", str(tmp_path / "1x4")],
                   cwd=ROOT, env=env, check=True, timeout=300)
    for name in ("identity", "topk", "powersgd"):
        a, b = np.load(tmp_path / "2x2" / f"{name}.npz"), np.load(tmp_path / "1x4" / f"{name}.npz")
        assert a["w"].shape == (4, 32, 16)
        assert np.abs(a["w"]).max() > 0.1  # it trained
        # Equal up to the order of float32 sums: 1e-6 of the parameters' scale.  PowerSGD's 20 steps of
        # orthonormalization amplify that order's rounding (measured 0.9e-6 and 1.2e-6 with two fusions of the
        # same update), so it gets 4e-6; a wrong exchange differs by orders of magnitude more.
        tol = 4e-6 if name == "powersgd" else 1e-6
        for k in ("w", "b"):
            assert np.abs(a[k] - b[k]).max() <= tol * np.abs(b[k]).max(), (name, k)


def test_lost_peer_is_named_and_a_restart_resumes(tmp_path):
    """Kill process 1 mid-run: process 0 names it and exits non-zero within 60 s; both restarted finish."""
    ckpt = tmp_path / "ck"
    argv = ["--compressor", "powersgd", "--epochs", "1", "--train-limit", "512", "--batch-size", "64",
            "--no-progress", "--out", str(tmp_path / "run.jsonl"), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "2", "--heartbeat-timeout", "5"]
    logs = tmp_path / "logs"
    proc = launch(2, 2, logs, *argv, wait=False, cache=tmp_path / "cache")
    deadline = time.time() + 240
    while "saving step 4" not in (logs / "process_0.log").read_text() if (logs / "process_0.log").exists() else True:
        assert time.time() < deadline and proc.poll() is None, "no checkpoint at step 4"
        time.sleep(0.2)
    pids = {}
    while len(pids) < 2:
        pids.update(re.findall(r"process (\d) \(pid (\d+)\)", proc.stdout.readline()))
    os.kill(int(pids["1"]), signal.SIGKILL)
    killed = time.time()
    out, _ = proc.communicate(timeout=120)
    log0 = (logs / "process_0.log").read_text()
    assert "[process 0] lost peer: process 1 of 2 stopped responding" in log0, log0[-2000:]
    assert "process 0: exit code 75" in out, out
    assert time.time() - killed < 60
    saved = Checkpointer(ckpt).all_steps()  # the saves that completed (the last one may not have)
    assert saved and saved[-1] >= 2, saved
    # The restart has no peer to lose: the default heartbeat timeout (20 s) rides out a loaded machine.
    again = launch(2, 2, tmp_path / "logs2", *argv[:-2], cache=tmp_path / "cache")
    assert again.returncode == 0, again.stdout
    log0 = (tmp_path / "logs2" / "process_0.log").read_text()
    assert f"resumed at step {saved[-1]}" in log0, log0
    summary = json.loads((tmp_path / "run.jsonl").read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["steps"] == 8 and summary["params_finite"]


def test_2d_mesh_compresses_only_over_the_slow_axis():
    """On a 2 x 4 mesh: a dense all-reduce inside each row, top-k's collectives only across rows, each device
    sending a quarter of its row's payload."""
    mesh = parallel.make_2d_mesh(2, 4)
    tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.sgd(0.1, momentum=0.9))
    init = {"w": jnp.zeros((20, 5)), "b": jnp.zeros(5)}

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2)

    p = parallel.replicate(init, mesh, fast_axis="fast")
    s = parallel.init_worker_state(tx, init, mesh, fast_axis="fast")
    step = parallel.data_parallel_step(loss, tx, mesh, fast_axis="fast")
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(32, 20)).astype(np.float32), rng.normal(size=(32, 5)).astype(np.float32))
               for _ in range(3)]
    ops = cj.audit_collectives(step, p, s, parallel.shard_batch(batches[0], mesh, fast_axis="fast"))
    ids = np.array([[d.id for d in row] for row in mesh.devices])
    rows = tuple(tuple(int(i) for i in r) for r in ids)  # the fast axis: one group per host
    cols = tuple(tuple(int(i) for i in c) for c in ids.T)  # the slow axis: one group per fast index
    fast = [op for op in ops if op.replica_groups == rows]
    slow = [op for op in ops if op.replica_groups == cols]
    assert len(fast) + len(slow) == len(ops)
    # Inside each row: the dense float32 gradient mean, the row's non-finite vote, and the all-gathers that
    # bring back the 2 workers' indices and values from the row's 4 pieces (11 pairs, padded to 12: 2 x 3 each).
    assert sorted((op.op, op.bytes) for op in fast) == [("all-gather", 24), ("all-gather", 24),
                                                        ("all-reduce", 4), ("all-reduce", 4 * 105)]
    assert sorted(op.op for op in slow) == ["all-gather", "all-gather", "all-reduce"]  # indices, values, vote
    for batch in batches:
        p, s, _ = jax.block_until_ready(step(p, s, parallel.shard_batch(batch, mesh, fast_axis="fast")))
    # Each device of a row sends a quarter of the row's payload across rows: payload_bytes is the row's (host's).
    assert int(cj.payload_bytes(s)[0]) == 4 * sum(op.bytes for op in slow)

    # Reference: a 2-worker 1-D run whose workers each hold their row's whole batch (the dense fast mean).
    mesh1 = parallel.make_mesh(2)
    p1, s1 = parallel.replicate(init, mesh1), parallel.init_worker_state(tx, init, mesh1)
    step1 = parallel.data_parallel_step(loss, tx, mesh1)
    for batch in batches:
        p1, s1, _ = jax.block_until_ready(step1(p1, s1, parallel.shard_batch(batch, mesh1)))
    got, want = parallel.gather(p), parallel.gather(p1)
    for k in init:
        assert np.abs(want[k]).max() > 0
        for w in range(8):  # worker w sits in row w // 4
            np.testing.assert_allclose(got[k][w], want[k][w // 4], rtol=1e-5, atol=1e-6)
