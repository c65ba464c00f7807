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
from tests.child_flags import xla_flags
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

    def __init__(self, role: str, config: dict, log: Path, devices: int = 1, users_codegen: bool = False):
        """``users_codegen``: XLA's default flags (the code users get), for a run whose bits are compared across
        processes; else the tests' fast-compile flags (half the compile time)."""
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        flags = f"--xla_force_host_platform_device_count={devices}" if users_codegen else xla_flags(devices)
        env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
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


def start(procs, role, config, log, users_codegen=False):
    p = Proc(role, config, log, users_codegen=users_codegen)
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
    plain and streaming, identity and chunktopk; the four runs one after the other in the same three processes.
    A fifth run compresses the replies (bfloat16 updates): each learner's anchors equal the syncer's global
    values bit for bit."""
    runs = [{"name": f"{comp}_P{P}", "P": P, "H": H, "steps": steps, "comp": comp, "versions": steps // H,
             "address": free_address()} for P, H, steps, comp in RUNS]
    # Then the replies compressed to bfloat16 updates: every learner's anchor is the syncer's global, bit for bit.
    runs.append({"name": "bf16_replies", "P": 2, "H": 4, "steps": 12, "comp": "chunktopk", "versions": 3,
                 "reply": "bfloat16", "address": free_address()})
    base = {"out": str(tmp_path), "learners": ["l0", "l1"], "n": 2, "runs": runs}
    # The learners' anchors are compared with the syncer's fragments bit for bit: XLA's default flags.
    syncer = start(procs, "syncer", base, tmp_path / "syncer.log", users_codegen=True)
    syncer.wait_for("syncer bound", "syncer start-up", timeout=START_S)
    learners = [start(procs, "learner", {**base, "name_self": f"l{i}", "index": i}, tmp_path / f"l{i}.log",
                      users_codegen=True) for i in range(2)]
    for run in runs:
        for i, lrn in enumerate(learners):
            lrn.wait_for(f"learner l{i} done {run['name']}", f"run {run['name']}: learner l{i} training",
                         timeout=START_S)
    for i, lrn in enumerate(learners):
        assert lrn.exit_code(f"learner l{i} exit") == 0, lrn.tail()
    for run in runs[:-1]:
        syncer.wait_for(f"syncer done {run['name']}", f"run {run['name']}: the syncer's end")
    syncer.stop()  # the last run is served until the learners are done
    assert f"syncer done {runs[-1]['name']}" in syncer.text(), syncer.tail()

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

    run = runs[-1]
    summary = json.loads((tmp_path / f"syncer_{run['name']}.json").read_text())
    assert summary["versions"] == [3, 3] and not summary["refused"], summary
    fragments = load(tmp_path / f"fragments_{run['name']}.npz")
    for w in range(2):
        anchors = load(tmp_path / f"anchor_{run['name']}_l{w}.npz")
        assert len(anchors) == len(fragments) > 0
        for a, b in zip(anchors, fragments):
            assert a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    exact = load(tmp_path / f"fragments_{runs[3]['name']}.npz")  # the same run with float32 replies
    assert not all(np.array_equal(a, b) for a, b in zip(fragments, exact))  # the replies were compressed
    for a, b in zip(fragments, exact):
        np.testing.assert_allclose(a, b, atol=0.02 * max(1.0, float(np.max(np.abs(b)))))


def fault_config(tmp_path, **run) -> dict:
    """One run of P=1, H=2 with learners that wait for each merge and train until the stop file appears."""
    return {"out": str(tmp_path), "n": 3, "P": 1, "H": 2, "steps": 100000, "comp": "identity", "wait": True,
            "step_sleep": 0.05, "stop_file": str(tmp_path / "stop"), "address": free_address(),
            "runs": [{"name": "run", **run}]}


def merges_in(log: str) -> list[tuple[int, list[str], str]]:
    """(version, learners, why) of every merge the syncer logged."""
    out = []
    for line in log.splitlines():
        if "merged fragment" in line:
            head, _, tail = line.partition(" from ")
            names, _, why = tail.rpartition(" (")
            out.append((int(head.split("(version ")[1].rstrip(")")), names.split(", "), why.rstrip(")")))
    return out


def start_learners(procs, tmp_path, config, names, indices=None):
    indices = range(len(names)) if indices is None else indices
    return [start(procs, "learner", {**config, "name_self": n, "index": i}, tmp_path / f"{n}.log")
            for n, i in zip(names, indices)]


def test_a_learner_killed_with_sigkill_is_logged_lost_and_the_other_goes_on(tmp_path, procs):
    """min_quorum both, grace 3 s, heartbeat timeout 5 s: after b's SIGKILL, a's syncs are merged without it."""
    config = fault_config(tmp_path, learners=["a", "b"], grace_s=3.0, heartbeat_timeout_s=5.0, max_staleness=2)
    syncer = start(procs, "syncer", config, tmp_path / "syncer.log")
    syncer.wait_for("syncer bound", "syncer start-up", timeout=START_S)
    a, b = start_learners(procs, tmp_path, config, ["a", "b"])
    syncer.wait_for("(version 3) from", "the first merges of a and b", timeout=START_S)
    b.p.send_signal(signal.SIGKILL)
    b.exit_code("b killed")
    killed_at = len(merges_in(syncer.text()))
    syncer.wait_for("learner 'b' lost", "b's loss noticed by the syncer")
    lost_at = len(merges_in(syncer.text()))
    syncer.wait_for("merged fragment", "a's syncs after b's loss", count=lost_at + 3)
    (tmp_path / "stop").touch()
    assert a.exit_code("a's end") == 0, a.tail()
    syncer.stop()
    merges = merges_in(syncer.text())
    assert all(names == ["a"] for _, names, _ in merges[killed_at + 1:]), merges  # the one in flight may hold b
    assert all(why == "quorum" for _, _, why in merges[lost_at:]), merges  # no more waiting for b once lost
    assert "no message for" in syncer.text()
    summary = json.loads((tmp_path / "syncer_run.json").read_text())
    assert summary["lost"] == ["b"] and not summary["refused"], summary
    assert json.loads((tmp_path / "learner_run_a.json").read_text())["refusals"] == []


def test_a_late_joiner_starts_from_the_current_model_and_its_first_contribution_is_merged(tmp_path, procs):
    config = fault_config(tmp_path, learners=["a", "b"], min_quorum=2, grace_s=5.0, max_staleness=8)
    syncer = start(procs, "syncer", config, tmp_path / "syncer.log")
    syncer.wait_for("syncer bound", "syncer start-up", timeout=START_S)
    start_learners(procs, tmp_path, config, ["a", "b"])
    syncer.wait_for("(version 2) from", "the first merges of a and b", timeout=START_S)
    (c,) = start_learners(procs, tmp_path, config, ["c"], indices=[2])
    c.wait_for("learner c joined", "c's join", timeout=START_S)
    syncer.wait_for("learner 'c' joined", "c's registration")
    c.wait_for("learner c step 1 ", "c's first step", timeout=START_S)
    c.wait_for("learner c step 11 ", "c's next syncs")
    (tmp_path / "stop").touch()
    for p in procs[1:]:
        assert p.exit_code("the learners' end") == 0, p.tail()
    syncer.stop()
    summary = json.loads((tmp_path / "syncer_run.json").read_text())
    stats = json.loads((tmp_path / "learner_run_c.json").read_text())
    assert summary["learners"] == ["a", "b", "c"] and not summary["refused"], summary
    assert stats["start_versions"][0] >= 2  # the global model at its join, not the initial one
    assert stats["sends"][0] >= 5 and stats["refusals"] == []  # every reply to c, its first included, a merge
    with_c = [m for m in merges_in(syncer.text()) if "c" in m[1]]
    assert len(with_c) == stats["sends"][0] and with_c[0][0] > stats["start_versions"][0], with_c


def test_a_restarted_syncer_resumes_bit_identical_to_its_checkpoint_and_learners_reconnect(tmp_path, procs):
    from compjax.decoupled import Syncer
    from tests.test_diloco import init_params

    ckpt = tmp_path / "ckpt"
    config = fault_config(tmp_path, learners=["a", "b"], max_staleness=4, checkpoint=str(ckpt))
    syncer = start(procs, "syncer", config, tmp_path / "syncer.log")
    syncer.wait_for("syncer bound", "syncer start-up", timeout=START_S)
    learners = start_learners(procs, tmp_path, config, ["a", "b"])
    syncer.wait_for("saved at least 3 merges", "the first checkpoints", timeout=START_S)
    syncer.p.send_signal(signal.SIGKILL)
    syncer.exit_code("syncer killed")
    again = start(procs, "syncer", {**config, "runs": [{**config["runs"][0], "name": "after", "restore_from": str(ckpt),
                                                        "checkpoint": str(tmp_path / "ckpt2")}]},
                  tmp_path / "syncer2.log")
    again.wait_for("syncer bound", "restarted syncer start-up", timeout=START_S)
    step = int(again.text().split("restored step ")[1].split()[0])
    for lrn in learners:
        lrn.wait_for("the syncer restarted", f"{lrn.log_path.stem} noticing the restart")
    # The welcome's refusal is received on the transport's thread ("syncer restarted: resuming"), then taken by
    # the learner's training thread before its next step, which records it in its stats and logs "the syncer
    # refused fragment 0: syncer restarted".  Wait for that second line: with the stop file touched between the
    # two (the merges below can be done already), the learner would end without having taken it.
    for lrn in learners:
        lrn.wait_for("the syncer refused fragment 0: syncer restarted",
                     f"{lrn.log_path.stem} taking the restarted syncer's model")
    again.wait_for("merged fragment", "merges after the restart", count=3)
    (tmp_path / "stop").touch()
    for lrn in learners:
        assert lrn.exit_code("the learners' end") == 0, lrn.tail()
    again.stop()
    reference = Syncer(init_params(), learners=["a", "b"])
    assert reference.restore(ckpt, step=step) == step
    restored = load(tmp_path / "restored_after.npz")
    for x, y in zip(restored, jax.tree.leaves(reference.global_params())):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()  # bit-identical
    assert sum(reference.versions()) >= 3
    summary = json.loads((tmp_path / "syncer_after.json").read_text())
    assert summary["merges"] and all(sorted(m[2]) == ["a", "b"] for m in summary["merges"]), summary
    assert summary["versions"][0] > reference.versions()[0]
    for name in ("a", "b"):  # each learner took the restarted syncer's model (a refusal that carries it)
        reasons = [r for _, r in json.loads((tmp_path / f"learner_run_{name}.json").read_text())["refusals"]]
        assert any(r.startswith("syncer restarted") for r in reasons), (name, reasons)


BAD = ["nonfinite", "wrong_fragment", "wrong_shape", "wrong_dtype", "too_large", "stale", "bad_tokens", "unknown"]


def test_bad_contributions_over_the_wire_are_refused_and_the_model_is_unchanged(tmp_path, procs):
    config = fault_config(tmp_path, learners=["bad"], min_quorum=1, max_staleness=0)
    config["runs"][0]["cases"] = BAD
    syncer = start(procs, "syncer", config, tmp_path / "syncer.log")
    syncer.wait_for("syncer bound", "syncer start-up", timeout=START_S)
    client = start(procs, "bad", {**config, "name_self": "bad"}, tmp_path / "bad.log")
    client.wait_for("bad done bad", "the bad contributions", timeout=START_S)
    assert client.exit_code("the client's end") == 0, client.tail()
    syncer.stop()
    result = json.loads((tmp_path / "bad_bad.json").read_text())
    answers = {case: answer for case, answer in result["answers"]}
    assert answers.pop("good")[0] is True
    assert answers.pop("unknown") == ["released", 1]  # no reply to a stranger, but its offer was let go
    reasons = {"nonfinite": "non-finite", "wrong_fragment": "wrong fragment", "wrong_shape": "wrong shape",
               "wrong_dtype": "wrong shape or dtype", "too_large": "bytes declared", "stale": "stale",
               "bad_tokens": "tokens"}
    for case, why in reasons.items():
        accepted, reason = answers[case]
        assert not accepted and why in reason, (case, reason)
    assert result["released"] == len(reasons) - 1  # every refusal but the non-finite one was never pulled
    summary = json.loads((tmp_path / "syncer_run.json").read_text())
    # The stranger never said hello: the transport drops its header (no address to pull from) before the syncer.
    assert summary["versions"] == [1] and len(summary["refused"]) == len(BAD) - 1, summary
    assert all(r[0] != "intruder" for r in summary["refused"])
    assert "dropped a header from learner 'intruder'" in (tmp_path / "syncer.log").read_text()
    merged = load(tmp_path / "merged_by_good.npz")
    for x, y in zip(load(tmp_path / "global_run.npz"), merged):
        assert x.tobytes() == y.astype(x.dtype).tobytes()  # the model is the good merge's, bit for bit
