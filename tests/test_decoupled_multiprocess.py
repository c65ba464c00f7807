"""Decoupled DiLoCo with the syncer and each learner in its own process (MultiProcessTransport: ZeroMQ control
frames, arrays over jax.experimental.transfer), each process with its own CPU device: equivalence with
cj.diloco, and the faults: a learner killed, a late join, a syncer restarted from its checkpoint, bad
contributions over the wire.

Every wait is bounded and its deadline starts when the awaited event becomes possible (a process's start-up
and compiles are slow on a loaded 2-core machine); a timeout names the phase it was in.  The processes are
tests/decoupled_procs.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import compjax as cj
from tests.helpers import AXIS
from tests.test_diloco import run_vmap

pytest.importorskip("zmq")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
START_S = 240  # a process's imports, its transfer server and first compiles, on a loaded machine
PHASE_S = 60  # any later event, from the moment it became possible


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Proc:
    """One process of tests/decoupled_procs.py, its output in a log file."""

    def __init__(self, role: str, config: dict, log: Path):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
        self.log_path, self.role = log, role
        self._file = log.open("w")
        self.p = subprocess.Popen([sys.executable, "-m", "tests.decoupled_procs", role, json.dumps(config)],
                                  cwd=ROOT, env=env, stdout=self._file, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, needle: str, phase: str, timeout: float = PHASE_S, count: int = 1) -> float:
        """Wait until ``needle`` occurs ``count`` times in the log; the time it did.  Fails naming ``phase``."""
        deadline = time.monotonic() + timeout
        while self.text().count(needle) < count:
            if self.p.poll() is not None and self.text().count(needle) < count:
                pytest.fail(f"{phase}: {self.role} exited ({self.p.returncode}) before {needle!r}:\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{phase}: no {needle!r} from the {self.role} within {timeout} s:\n{self.tail()}")
            time.sleep(0.1)
        return time.monotonic()

    def exit_code(self, phase: str, timeout: float = PHASE_S) -> int:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{phase}: the {self.role} did not exit within {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.text()[-n:]

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._file.close()


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in started:
        if p.p.poll() is None:
            p.p.kill()
            p.p.wait()
        p._file.close()


def start(procs, role, config, log):
    p = Proc(role, config, log)
    procs.append(p)
    return p


def load(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def compressor(name, axis_name):
    if name == "identity":
        return cj.identity(axis_name, skip_nonfinite=False)
    return cj.chunktopk(2, chunk=4, skip_nonfinite=False, axis_name=axis_name)


RUNS = [(P, H, steps, comp) for P, H, steps in [(1, 2, 6), (2, 4, 12)] for comp in ("identity", "chunktopk")]


def test_two_learner_processes_equal_diloco_in_one_spmd_program(tmp_path, procs):
    """min_quorum = both, no grace limit, waiting learners: the global parameters of cj.diloco under vmap (1e-5),
    plain and streaming, identity and chunktopk; the four runs one after the other in the same three processes."""
    runs = [{"name": f"{comp}_P{P}", "P": P, "H": H, "steps": steps, "comp": comp, "versions": steps // H,
             "address": free_address()} for P, H, steps, comp in RUNS]
    base = {"out": str(tmp_path), "learners": ["l0", "l1"], "n": 2, "runs": runs}
    syncer = start(procs, "syncer", base, tmp_path / "syncer.log")
    syncer.wait_for("syncer bound", "syncer start-up", timeout=START_S)
    learners = [start(procs, "learner", {**base, "name_self": f"l{i}", "index": i}, tmp_path / f"l{i}.log")
                for i in range(2)]
    for run in runs:
        for i, lrn in enumerate(learners):
            lrn.wait_for(f"learner l{i} done {run['name']}", f"run {run['name']}: learner l{i} training",
                         timeout=START_S)
    for i, lrn in enumerate(learners):
        assert lrn.exit_code(f"learner l{i} exit") == 0, lrn.tail()
    for run in runs:
        syncer.wait_for(f"syncer done {run['name']}", f"run {run['name']}: the syncer's end")
    syncer.stop()

    for (P, H, steps, comp), run in zip(RUNS, runs):
        tx = cj.diloco(optax.sgd(0.1), sync_every=H, fragments=P, compressor=compressor(comp, AXIS), axis_name=AXIS)
        hist, _, state = run_vmap(tx, steps, 2)
        one = lambda tree: jax.tree.map(lambda x: np.asarray(x)[0], tree)
        want = jax.tree.leaves(cj.diloco_global_params(one(state), one(hist[-1])))
        summary = json.loads((tmp_path / f"syncer_{run['name']}.json").read_text())
        assert summary["versions"] == [steps // H] * P and not summary["refused"], summary
        assert all(sorted(m[2]) == ["l0", "l1"] for m in summary["merges"])
        got = load(tmp_path / f"global_{run['name']}.npz")
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=run["name"])
        for w in range(2):  # each learner's own parameters: the SPMD run's worker's
            mine = load(tmp_path / f"learner_{run['name']}_l{w}.npz")
            for a, b in zip(mine, jax.tree.leaves(hist[-1])):
                np.testing.assert_allclose(a, b[w], rtol=1e-5, atol=1e-5, err_msg=run["name"])
