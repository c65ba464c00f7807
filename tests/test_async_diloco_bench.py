"""The decoupled DiLoCo benchmark and launcher: their short settings run, and their numbers hang together.

The slow tests start real processes (a syncer and two learners over ZeroMQ and jax.experimental.transfer)
on the committed Tiny Shakespeare excerpt; nothing is downloaded and nothing is timed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest

from experiments import async_diloco as launcher
from experiments.benchmarks import async_diloco as bench
from tests.child_flags import xla_flags
from tests.tiny_shakespeare import EXCERPT


def _child_env() -> dict:
    """The launcher's environment of a role's process (one CPU device, the repository importable), which keeps the
    tests' XLA:CPU flags: a role started here compiles in half the time (the checks are counts, bytes and
    versions)."""
    env = launcher.child_env()
    assert env["XLA_FLAGS"] == xla_flags()  # the test process's flags less its device count
    return env


def _learner(name, goodput, tps, steps=100, killed=False):
    if killed:
        return {"name": name, "killed": True, "steps": steps}
    return {"name": name, "goodput": goodput, "tokens_per_s": tps, "steps": steps, "bytes_sent": [10, 10],
            "delays": [[1], [2]], "wait_s": 0.1}


def _row(name, mode, goodputs, tps, loss, learners=None, tc=None):
    settings = {**bench.FULL, "learners": 4}
    carried = {"contributions": 1000, "replies": 1000, "released": 0, "control": 100, "welcomes": [[0.0, "x", 5]]}
    row = {"name": name, "rate": "10 Mbit/s", "mode": mode, "settings": settings, "t_go": 1.0, "duration_s": 10.0,
           "events": {}, "learners": learners or [_learner(f"learner{i}", g, tps) for i, g in enumerate(goodputs)],
           "syncer": {"carried": carried, "val_loss": loss, "versions": [1], "merges": [], "refused": [], "lost": [],
                      "num_params": 10, "val_curve": [{"t": 1.0, "versions": [0], "val_loss": loss}]}}
    if tc is not None:
        row["tc"] = {"bytes": tc, "packets": 10, "dropped": 0}
    return row


def test_targets_from_rows():
    """The targets read the right rows: goodput min vs lock-step, the straggler's others, losses, kernel bytes."""
    raw = [_row("lock-step 10 Mbit/s", "lockstep", [0.5] * 4, 1000.0, 2.00, tc=2100 + 660),
           _row("async 10 Mbit/s", "async", [0.9, 0.95, 0.9, 0.88], 1000.0, 2.03, tc=2100 + 660),
           _row("straggler 10 Mbit/s", "straggler", [0.9, 0.9, 0.9, 0.45], 950.0, 2.1, tc=3100),
           _row("fault 10 Mbit/s", "fault", None, 1000.0, 2.10,
                learners=[_learner("learner0", 0.9, 1000.0), _learner("learner1", 0, 0, killed=True),
                          _learner("learner2", 0.9, 1000.0), _learner("learner3", 0.9, 1000.0),
                          _learner("learner4", 0.1, 10.0, steps=30)]),
           _row("lock-step 100 Mbit/s", "lockstep", [0.8] * 4, 1000.0, 2.20),
           _row("async 100 Mbit/s", "async", [0.9] * 4, 1000.0, 2.09)]
    report = bench.build_report(raw, ["--x"], 1.0, {"loadavg_start": [0.0], "loadavg_end": [0.0]}, bench.FULL)
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["straggler 10 Mbit/s"]["goodput_min"] == 0.9  # the straggler itself is left out
    assert rows["fault 10 Mbit/s"]["goodput_min"] == 0.9  # the joiner is left out, the killed one has none
    assert rows["fault 10 Mbit/s"]["tokens"] == (3 * 100 + 100 + 30) * 16 * 64  # the killed learner's steps count
    assert rows["async 10 Mbit/s"]["kernel_ratio"] == pytest.approx(1.0)  # welcomes before t_go left out
    met = lambda words: next(t for t in report["targets"] if words in t["target"])["met"]
    assert met("goodput") is True  # 88% >= 85%, lock-step's 50% lower
    assert met("straggler: the others") is True  # 950 / 1000 tokens/s
    assert met("fault run") is False  # 2.10 / 2.03 = +3.4%
    assert met("kernel bytes") is False  # the straggler row's 3100 / 2760
    loss10, loss100 = (t for t in report["targets"] if "validation loss" in t["target"])
    assert loss10["met"] is True and "+1.5%" in loss10["measured"]
    assert loss100["met"] is True and "-5.0%" in loss100["measured"]  # one-sided: a lower loss is within
    assert len(report["targets"]) == 8  # the refusal target twice: the async and the straggler rows
    md = bench.to_markdown(report)
    assert "| target | measured | met |" in md and "| fault 10 Mbit/s |" in md


@pytest.mark.slow
def test_quick_benchmark(tmp_path):
    """--quick: both rows, the same tokens, goodput in (0, 1], bytes counted and carried, a loss that fell."""
    # --idle-s 0: the idle window before each row is the baseline of tc's kernel counters, read only in shaped rows
    # (--quick shapes none); the default waits 3 s per row for nothing here.
    assert bench.main(["--quick", "--idle-s", "0", "--text", str(EXCERPT), "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "async_diloco.json").read_text())
    md = (tmp_path / "async_diloco.md").read_text()
    assert (tmp_path / "async_diloco.png").stat().st_size > 0
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"lock-step unshaped", "async unshaped"}
    s = bench.QUICK
    sends = s["learners"] * s["fragments"] * (s["steps"] // s["sync_every"])
    for name, r in rows.items():
        assert f"| {name} |" in md
        assert r["tokens"] == s["learners"] * s["steps"] * s["batch"] * s["seq_len"]
        assert all(0 < g <= 1 for g in r["goodput"].values()), r["goodput"]
        assert all(t > 0 for t in r["tokens_per_s"].values())
        assert r["counted_bytes"] > 0 and r["replies_carried"] > 0
        assert r["contributions_carried"] >= r["counted_bytes"]  # the payload arrays (+ control frames)
        assert r["merges"] + r["refused"] <= sends
        raw = next(x for x in report["raw"] if x["name"] == name)
        curve = raw["syncer"]["val_curve"]
        assert math.isfinite(r["val_loss"]) and r["val_loss"] < curve[0]["val_loss"]
        scheduled = s["fragments"] * s["steps"] // s["sync_every"]
        per_learner = [sum(x["sends"]) for x in raw["learners"]]
        if name.startswith("lock-step"):
            assert per_learner == [scheduled] * 2
        else:  # late_reply="defer": a fragment due while its merge is out goes later, once (never more sends)
            assert all(s["fragments"] <= n <= scheduled for n in per_learner), per_learner
        for x in raw["learners"]:  # paced: every step's compute padded to the pace, or over it
            assert x["pace_s"] == s["step_time_s"] > 0
            assert x["step_s"] + x["pad_s"] >= x["steps"] * x["pace_s"] * (1 - 1e-6), x
            assert x["pad_s"] > 0 and x["overruns"] < x["steps"], x  # 100 ms: well above a step's compute
            assert x["goodput"] == pytest.approx((x["step_s"] + x["pad_s"]) / x["loop_s"])
    lock, asyn = rows["lock-step unshaped"], rows["async unshaped"]
    assert asyn["counted_bytes"] <= lock["counted_bytes"]  # the same messages, no more of them
    assert lock["versions"] == [s["steps"] // s["sync_every"]] * s["fragments"]  # full quorum: one merge per send round
    assert lock["merges"] == sends // s["learners"]
    assert lock["refused"] == 0 and lock["lost"] == []
    lock_raw = next(x for x in report["raw"] if x["name"] == "lock-step unshaped")
    # lock-step learners take each merged fragment before their next inner step: no delay, ever
    assert all(d == 0 for x in lock_raw["learners"] for f in x["delays"] for d in f)


@pytest.mark.slow
def test_launcher(tmp_path):
    """The launcher starts a syncer and two learners over CURVE (the keys role's certificates), prints each role's
    command, and writes its results."""
    out = tmp_path / "run"
    assert launcher.main(["keys", "--keys", str(tmp_path / "certs"), "--learners", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "certs" / "allowed").iterdir()) == ["learner0.key", "learner1.key"]
    r = subprocess.run([sys.executable, "-m", "experiments.async_diloco", "--learners", "2", "--steps", "20",
                        "--sync-every", "10", "--fragments", "1", "--compressor", "identity", "--text", str(EXCERPT),
                        "--out", str(out), "--keys", str(tmp_path / "certs")], capture_output=True, text=True,
                       timeout=600, check=False, cwd=launcher.REPO, env=_child_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    commands = [line.strip() for line in r.stdout.splitlines() if line.startswith("  python -m experiments.async_diloco")]
    assert len(commands) == 3 and " syncer " in commands[0] and "--index 1" in commands[2]
    assert all("--keys" in c for c in commands)
    address = commands[0].split("--address ")[1].split()[0]
    assert all(f"--address {address}" in c for c in commands)
    syncer = json.loads((out / "syncer.json").read_text())
    assert syncer["versions"] == [2] and syncer["min_quorum"] == 2  # default quorum N - 1, at least 2
    for i in range(2):
        stats = json.loads((out / f"learner{i}.json").read_text())
        assert stats["steps"] == 20 and stats["sends"] == [2]
        assert stats["bytes_sent"] == [2 * 4 * syncer["num_params"]]  # identity: float32, every parameter
    assert (out / "global.npz").exists()
    from compjax.checkpoint import Checkpointer

    with Checkpointer(out / "syncer_checkpoint") as ckpt:  # written when the launcher stopped it (SIGTERM)
        assert ckpt.latest_step() == 2  # merges so far: what a --resume starts from
    # The syncer role restarted with --resume takes the checkpoint up: its versions go on from [2].
    args = launcher.parser().parse_args(["--learners", "2", "--steps", "20", "--sync-every", "10", "--fragments", "1",
                                         "--compressor", "identity", "--text", str(EXCERPT), "--out",
                                         str(tmp_path / "resumed"), "--address", launcher.free_address()])
    cmd = [sys.executable, "-m", "experiments.async_diloco", *launcher.role_args(args, "syncer"), "--resume",
           "--checkpoint-dir", str(out / "syncer_checkpoint")]
    proc = subprocess.Popen(cmd, cwd=launcher.REPO, env=_child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # serving once bound: then stopped
        seen.append(line)
        if "syncer bound" in line:
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, "".join(seen[-40:])
    assert any("syncer resumed from" in x and "versions [2]" in x for x in seen), "".join(seen[-40:])
    assert json.loads((tmp_path / "resumed" / "syncer.json").read_text())["versions"] == [2]


def test_a_role_gets_one_device_and_keeps_the_other_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    env = launcher.child_env()
    assert env["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(launcher.REPO)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "XLA_FLAGS" not in launcher.child_env()


def test_launcher_writes_under_ignored_runs():
    """Runs go to runs/ (git-ignored), and bad settings are refused before anything starts."""
    assert launcher.RUNS.relative_to(launcher.REPO).parts[0] == "runs"
    assert "/runs/" in (launcher.REPO / ".gitignore").read_text().splitlines()
    with pytest.raises(ValueError, match="--min-quorum"):
        launcher.main(["--learners", "2", "--min-quorum", "3"])
    with pytest.raises(ValueError, match="--steps"):
        launcher.main(["--steps", "0"])
    with pytest.raises(ValueError, match="--step-time-s"):
        launcher.main(["--step-time-s", "-0.01"])


def test_a_rows_folder_starts_empty_so_an_earlier_runs_join_file_cannot_start_its_joiner(tmp_path):
    old = bench.row_dir(tmp_path, "fault 10 Mbit/s")
    (old / "join").write_text("join")
    (old / "go").write_text("go")
    new = bench.row_dir(tmp_path, "fault 10 Mbit/s")
    assert new == old and list(new.iterdir()) == []


def test_system_columns_from_a_row():
    """System throughput is all tokens over the time from the start to the last learner's last step (not the mean
    of each learner's rate); refusals are a share of the contributions received, grouped by reason; merges are
    counted by contributors; the wait splits into the last arrival's (link) and the rest (straggler)."""
    learners = [{**_learner(f"learner{i}", 0.9, 1000.0, steps=100), "started": 1.0, "loop_s": loop, "step_s": step,
                 "wall_s": loop + 1.0, "wait_s": wait} for i, (loop, step, wait) in enumerate([(10.0, 2.0, 1.0), (20.0, 4.0, 3.0)])]
    row = _row("async 10 Mbit/s", "async", None, 1000.0, 2.0, learners=learners)
    row["syncer"]["merges"] = [[0, 1, ["learner0", "learner1"]], [0, 2, ["learner0"]], [0, 3, ["learner1"]]]
    row["syncer"]["refused"] = [["learner0", 0, "stale: staleness 2 > max_staleness 1"],
                                ["learner1", 0, "replayed: sequence number 3 is not above 3"],
                                ["learner1", 0, "stale: staleness 3 > max_staleness 1"]]
    r = bench.summarize(row)
    assert r["tokens"] == 200 * 16 * 64
    assert r["system_tokens_per_s"] == pytest.approx(200 * 16 * 64 / 20.0)  # the last step ends 20 s after t_go
    assert r["step_ms_mean"] == pytest.approx(1000 * (0.02 + 0.04) / 2)
    assert r["refused_share"] == pytest.approx(3 / 7) and r["refused_why"] == {"replayed": 1, "stale": 2}
    assert r["merges_by_contributors"] == {"1": 2, "2": 1}
    assert r["link_wait_s"] == 1.0 and r["straggler_wait_s"] == pytest.approx(1.0)
    md = bench.to_markdown(bench.build_report([row], ["--x"], 1.0, {"loadavg_start": [0.0], "loadavg_end": [0.0]},
                                              bench.FULL))
    assert "| async 10 Mbit/s | 10,240 | 30.0 | 43% (replayed 1, stale 2) | 1: 2, 2: 1 | 1.0 / 1.0 |" in md
    assert r["overrun_share"] == 0 and r["paced_ms_mean"] == r["step_ms_mean"]  # not paced


def test_paced_rows_report_the_padded_step_and_the_steps_over_the_pace():
    """A paced learner's step is its compute padded to the pace: the row gives both, and the share of steps whose
    compute alone took longer (learner0: 100 steps, 2 s of compute, 4 s of padding, 5 steps over the pace)."""
    learners = [{**_learner(f"learner{i}", 0.9, 1000.0, steps=100), "started": 1.0, "loop_s": 10.0, "step_s": 2.0,
                 "wall_s": 11.0, "wait_s": 1.0, "pace_s": 0.06, "pad_s": pad, "overruns": over}
                for i, (pad, over) in enumerate([(4.0, 5), (3.0, 15)])]
    r = bench.summarize(_row("async 10 Mbit/s", "async", None, 1000.0, 2.0, learners=learners))
    assert r["step_ms_mean"] == pytest.approx(20.0)
    assert r["paced_ms_mean"] == pytest.approx(1000 * (0.06 + 0.05) / 2)
    assert r["overrun_share"] == pytest.approx(20 / 200)
    md = bench.to_markdown(bench.build_report([_row("async 10 Mbit/s", "async", None, 1000.0, 2.0,
                                                    learners=learners)], ["--x"], 1.0,
                                              {"loadavg_start": [0.0], "loadavg_end": [0.0]}, bench.FULL))
    assert "| 20.0 / 55.0 (10.0%) |" in md


def _timed(loop):
    return [{**_learner(f"learner{i}", 0.9, 1000.0), "started": 1.0, "loop_s": loop, "step_s": 1.0,
             "wall_s": loop + 1.0, "wait_s": 0.5} for i in range(4)]


@pytest.mark.parametrize("lockstep_loop, met", [(14.0, True), (12.0, False)])
def test_the_straggler_target_compares_system_throughput_with_lock_step_s_straggler_row(lockstep_loop, met):
    """Async with a straggler against lock-step with the same straggler: all tokens over the time to the last
    learner's last step, 1.3x or more (the same tokens, 10 s against 14 s: 1.4x; against 12 s: 1.2x)."""
    raw = [_row("straggler 10 Mbit/s", "straggler", None, 1000.0, 2.0, learners=_timed(10.0)),
           _row("lock-step straggler 10 Mbit/s", "lockstep-straggler", None, 1000.0, 2.0,
                learners=_timed(lockstep_loop))]
    report = bench.build_report(raw, ["--x"], 1.0, {"loadavg_start": [0.0], "loadavg_end": [0.0]}, bench.FULL)
    (target,) = [t for t in report["targets"] if "1.3x" in t["target"]]
    assert target["met"] is met and f"({lockstep_loop / 10.0:.2f}x)" in target["measured"]


@pytest.mark.parametrize("refused, singles, met", [(1, 1, True), (2, 1, False), (0, 3, False)])
def test_the_refusal_target_counts_refused_contributions_and_merges_with_several_contributors(refused, singles, met):
    """At most 10% of the contributions received refused, and more than half of the merges with 2 or more
    contributors: 3 merges of 3 contributors (9) and ``singles`` merges of one, plus ``refused`` refusals."""
    row = _row("straggler 10 Mbit/s", "straggler", None, 1000.0, 2.0, learners=_timed(10.0))
    row["syncer"]["merges"] = ([[0, v, ["learner0", "learner1", "learner2"]] for v in range(3)]
                               + [[1, v, ["learner3"]] for v in range(singles)])
    row["syncer"]["refused"] = [["learner3", 1, "stale: staleness 3 > max_staleness 2"]] * refused
    report = bench.build_report([row], ["--x"], 1.0, {"loadavg_start": [0.0], "loadavg_end": [0.0]}, bench.FULL)
    (target,) = [t for t in report["targets"] if "refused" in t["target"]]
    received = 9 + singles + refused
    assert target["met"] is met
    assert f"{refused / received:.1%} refused; 3 of {3 + singles} merges" in target["measured"]


def test_a_restarted_syncers_record_joins_the_first_ones():
    """The fault row's syncer, stopped and restarted with --resume: merges, refusals, losses and the curve of both,
    carried bytes summed, the final state the successor's."""
    def record(merges, loss, nbytes):
        return {"merges": merges, "refused": [["a", 0, "stale"]], "lost": [], "versions": [len(merges)],
                "val_loss": loss, "val_curve": [{"t": 0.0, "val_loss": loss}],
                "carried": {"contributions": nbytes, "replies": 1, "released": 0, "control": 2,
                            "welcomes": [[0.0, "x", 5]]}}

    joined = bench.join_syncers(record([[0, 1, ["a"]]], 3.0, 100), record([[0, 2, ["a"]], [0, 3, ["a"]]], 2.0, 50))
    assert [m[1] for m in joined["merges"]] == [1, 2, 3] and len(joined["refused"]) == 2
    assert joined["carried"]["contributions"] == 150 and len(joined["carried"]["welcomes"]) == 2
    assert joined["val_loss"] == 2.0 and [c["val_loss"] for c in joined["val_curve"]] == [3.0, 2.0]
    assert joined["restarted"] == {"before_versions": [1], "before_val_loss": 3.0}
