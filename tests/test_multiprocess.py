"""Several processes through jax.distributed (gloo on localhost), 2-D meshes, and a lost peer."""

from __future__ import annotations

import contextlib
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
import pytest

import compjax as cj
from compjax import parallel
from compjax.checkpoint import Checkpointer
from tests.child_flags import xla_flags

ROOT = Path(__file__).resolve().parent.parent


def _env(cache: Path | None = None):
    env = dict(os.environ)
    # Each command sets its own device count; the processes compile with the tests' fast-compile flags (half the
    # compile time; what is checked below is a tolerance and messages, not bits).
    env["XLA_FLAGS"] = xla_flags()
    if cache is not None:  # a persistent compilation cache: a restarted run compiles nothing
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


@pytest.fixture(scope="module")
def pace():
    """Seconds a fresh process takes here and now to import JAX and compjax and compile and run a small
    program: the unit of the wall-clock limits below (under 3 s on an idle 2-core machine; more under other
    jobs' load), so a loaded machine gets proportionally longer.  The limits only catch a run that hangs."""
    code = ("import jax, jax.numpy as jnp, compjax; "
            "jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((256, 256))).block_until_ready()")
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), check=True, timeout=600)
    return time.monotonic() - start


def limit(pace: float, floor: float, paces: float) -> float:
    """A phase's wall-clock limit: ``floor`` seconds, or ``paces`` times the measured pace if longer."""
    return max(floor, paces * pace)


def run(cmd, phase: str, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` that, on a timeout, fails naming the phase and its limit."""
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
                              **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"phase '{phase}': not finished within its limit of {timeout:.0f} s\n{e.stdout}")


def wait_for(phase: str, timeout: float, done, proc: subprocess.Popen) -> float:
    """Poll ``done()`` until true (returns the seconds it took); fail naming the phase if the launcher exits
    first or ``timeout`` seconds pass, counted from this call (when the awaited event becomes possible)."""
    start = time.monotonic()
    while not done():
        if proc.poll() is not None:
            pytest.fail(f"phase '{phase}': the launcher exited (code {proc.returncode}) before it was done")
        if time.monotonic() - start > timeout:
            pytest.fail(f"phase '{phase}': not done within its limit of {timeout:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - start


def launch(processes: int, devices: int, log_dir: Path, *argv: str, module: str = "experiments.train",
           wait: bool = True, cache: Path | None = None, phase: str = "", timeout: float = 300):
    """Run ``experiments.launch`` (``wait``: to its end, failing after ``timeout`` s naming ``phase``; else a
    Popen whose output is a pipe)."""
    cmd = [sys.executable, "-m", "experiments.launch", "--processes", str(processes), "--devices-per-process",
           str(devices), "--module", module, "--log-dir", str(log_dir), "--", *argv]
    if wait:
        return run(cmd, phase, timeout, env=_env(cache))
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.slow  # several processes
def test_two_processes_match_one_process(tmp_path, pace):
    """2 processes x 2 CPU devices (gloo) == 1 process x 4 devices after 20 steps, for three compressors."""
    two = launch(2, 2, tmp_path / "logs", "--out", str(tmp_path / "2x2"), module="experiments.distributed_check",
                 phase="2 processes x 2 devices, 20 steps", timeout=limit(pace, 300, 150))
    assert two.returncode == 0, two.stdout + (tmp_path / "logs" / "process_1.log").read_text()
    assert "process 1 of 2: 4 workers" in (tmp_path / "logs" / "process_1.log").read_text()
    env = {**_env(), "XLA_FLAGS": xla_flags(4)}
    one = run([sys.executable, "-m", "experiments.distributed_check", "--out", str(tmp_path / "1x4")],
              "1 process x 4 devices, 20 steps", limit(pace, 300, 150), env=env)
    assert one.returncode == 0, one.stdout + one.stderr
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


@pytest.mark.slow  # several processes
def test_lost_peer_is_named_and_a_restart_resumes(tmp_path, pace):
    """Kill process 1 mid-run: process 0 names it and exits non-zero within the heartbeat timeout (and a margin);
    both restarted finish.

    Each phase's limit counts from the moment its event becomes possible (the checkpoint at step 4 from the
    run's first line, the lost peer from the kill) and grows with the machine's measured pace: on a loaded
    machine a run compiles slowly, but a lost peer must still be named once the heartbeat timeout has passed."""
    ckpt = tmp_path / "ck"
    heartbeat = 5
    argv = ["--compressor", "powersgd", "--epochs", "1", "--train-limit", "512", "--batch-size", "64",
            "--no-progress", "--out", str(tmp_path / "run.jsonl"), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "2", "--heartbeat-timeout", str(heartbeat)]
    logs = tmp_path / "logs"
    proc = launch(2, 2, logs, *argv, wait=False, cache=tmp_path / "cache")
    pids = {}
    try:
        while len(pids) < 2:  # the launcher prints each process's pid as it starts it
            line = proc.stdout.readline()
            assert line, f"phase 'launch': the launcher exited before starting 2 processes: {pids}"
            pids.update(re.findall(r"process (\d) \(pid (\d+)\)", line))

        def log0() -> str:
            return (logs / "process_0.log").read_text() if (logs / "process_0.log").exists() else ""

        # Start-up (JAX, the coordination service, the data), then compiling and the first 4 steps.
        wait_for("start-up: process 0's first line", limit(pace, 120, 60), lambda: "compjax main job" in log0(),
                 proc)
        wait_for("training: process 0 saving the checkpoint of step 4", limit(pace, 240, 120),
                 lambda: "saving step 4" in log0(), proc)
        os.kill(int(pids["1"]), signal.SIGKILL)
        # The lost peer: named within the heartbeat timeout, plus a margin for a loaded machine.
        try:
            out, _ = proc.communicate(timeout=heartbeat + limit(pace, 55, 20))
        except subprocess.TimeoutExpired:
            pytest.fail(f"phase 'lost peer': process 0 still running {heartbeat + limit(pace, 55, 20):.0f} s after "
                        f"process 1 was killed (heartbeat timeout {heartbeat} s)\n{log0()[-2000:]}")
    finally:  # a failed phase leaves no process behind
        if proc.poll() is None:
            for pid in pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            proc.kill()
            proc.communicate()
    assert "[process 0] lost peer: process 1 of 2 stopped responding" in log0(), log0()[-2000:]
    assert "process 0: exit code 75" in out, out
    saved = Checkpointer(ckpt).all_steps()  # the saves that completed (the last one may not have)
    assert saved and saved[-1] >= 2, saved
    # The restart has no peer to lose: the default heartbeat timeout (20 s) rides out a loaded machine.
    again = launch(2, 2, tmp_path / "logs2", *argv[:-2], cache=tmp_path / "cache",
                   phase="restart: both processes resume and finish", timeout=limit(pace, 300, 150))
    assert again.returncode == 0, again.stdout
    restarted = (tmp_path / "logs2" / "process_0.log").read_text()
    assert f"resumed at step {saved[-1]}" in restarted, restarted
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
