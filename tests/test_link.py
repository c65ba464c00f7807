"""The link benchmark's parts that run anywhere, gloo's wire model, and one short real measurement where permitted.

The real measurement needs a network namespace and ``tc`` (root, or
CAP_SYS_ADMIN + CAP_NET_ADMIN); where they are not permitted that test is
skipped with the reason, and the benchmark itself exits 0 after one line.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import netmodel, parallel
from experiments.benchmarks import link

TBF = """qdisc tbf 8001: root refcnt 2 rate 100Mbit burst 64Kb lat 400ms 
 Sent 5283186 bytes 4731 pkt (dropped 3, overlimits 812 requeues 0) 
 backlog 0b 0p requeues 0
"""
PFIFO = """qdisc pfifo 8002: root refcnt 2 limit 10000p
 Sent 42 bytes 1 pkt (dropped 0, overlimits 0 requeues 0) 
 backlog 0b 0p requeues 0
"""
NOQUEUE = "qdisc noqueue 0: root refcnt 2 \n"


def test_tc_parser_reads_the_root_qdisc():
    assert link.parse_tc_sent(TBF) == (5283186, 4731)
    assert link.parse_tc_dropped(TBF) == 3
    assert link.parse_tc_sent(PFIFO) == (42, 1)
    assert link.parse_tc_dropped(PFIFO) == 0
    # a child qdisc's counters are not the root's
    child = "qdisc pfifo 10: parent 8001:1 limit 100p\n Sent 7 bytes 1 pkt (dropped 0, overlimits 0 requeues 0)\n" + TBF
    assert link.parse_tc_sent(child) == (5283186, 4731)
    with pytest.raises(ValueError, match="Sent"):
        link.parse_tc_sent(NOQUEUE)  # loopback's default qdisc keeps no counters


def _ops_json(ops):
    return [{"op": o.op, "operands": [[d, list(s)] for d, s in o.operands], "bytes": o.bytes} for o in ops]


@pytest.mark.parametrize("name", ["identity", "topk(0.01)"])
def test_predicted_wire_bytes_of_an_audited_step(name):
    """The prediction reads the audited step: its operands add up to payload_bytes; the traffic follows the ring."""
    n = 4
    mesh = parallel.make_mesh(n)
    comp = cj.identity(axis_name="data") if name == "identity" else cj.topk(0.01, axis_name="data")
    tx = optax.chain(comp, optax.sgd(0.1))
    init = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2)

    p, s = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    step = parallel.data_parallel_step(loss, tx, mesh)
    rng = np.random.default_rng(0)
    batch = parallel.shard_batch((rng.normal(size=(16, 64)).astype(np.float32),
                                  rng.normal(size=(16, 32)).astype(np.float32)), mesh)
    ops = _ops_json(cj.audit_collectives(step, p, s, batch))
    _, s, _ = step(p, s, batch)
    payload = int(cj.payload_bytes(s)[0])
    assert sum(o["bytes"] for o in ops) == payload
    factor = {"all-reduce": 2 * (n - 1), "all-gather": n * (n - 1)}
    assert link.predicted_wire_bytes(ops, n, netmodel.Framing.none) == sum(factor[o["op"]] * o["bytes"] for o in ops)
    framed = link.predicted_wire_bytes(ops, n)
    messages = sum(len(netmodel.gloo_messages(o["op"], math.prod(sh) * link.ELEMENT_BYTES[d], n,
                                              link.ELEMENT_BYTES[d])) for o in ops for d, sh in o["operands"])
    assert framed >= link.predicted_wire_bytes(ops, n, netmodel.Framing.none) + messages * (3 * 48 + 3.5 * 66)


def _raw(kernel_identity: int, kernel_topk: int, step_identity: float, step_topk: float, compute: float = 0.01,
         probe: float = 0.0) -> dict:
    """A run of 2 processes as the worker writes it: dense and top-k at 10 Mbit/s, 2 steps each."""
    ops_id = [{"op": "all-reduce", "operands": [["s32", []]], "bytes": 4},
              {"op": "all-reduce", "operands": [["f32", [1000]]], "bytes": 4000}]
    ops_tk = [{"op": "all-reduce", "operands": [["s32", []]], "bytes": 4},
              {"op": "all-gather", "operands": [["f32", [1, 10]]], "bytes": 40},
              {"op": "all-gather", "operands": [["s32", [1, 10]]], "bytes": 40}]
    idle = {"bytes": 1000, "packets": 10, "seconds": 2.0}
    meas = []
    for m, k, t, pb in (("identity", kernel_identity, step_identity, 4004), ("topk(0.01)", kernel_topk, step_topk, 84)):
        marks = [[[0.0, t], [1.0, 1.0 + t]], [[0.0, t - 0.001], [0.9, 1.0 + t - 0.002]]]  # process 1 a little ahead
        meas.append({"model": "cnn", "method": m, "rate": "10 Mbit/s", "bits_per_s": 10e6, "steps": 2, "warmup": 1,
                     "marks_s": marks, "step_s": link.global_steps(marks), "payload_bytes": [pb, pb],
                     "compute_by_process_s": [[compute] * 2] * 2, "compute_s": [compute] * 2,
                     "kernel_bytes": 2 * k + 1000, "kernel_packets": 30, "dropped": 0, "idle": idle, "tc": []})
    # the probe's calls at 10 Mbit/s: their own wire bytes' time plus `probe`
    own = link.predicted_wire_bytes([{"op": "all-reduce", "operands": [["f32", [1]]], "bytes": 4}], 2) * 8 / 10e6
    probe_ops = [{"op": "all-reduce", "operands": [["f32", [1]]], "bytes": 4}]
    return {"processes": 2, "loadavg_start": [0.5, 0.5, 0.5], "loadavg_end": [0.6, 0.6, 0.6],
            "latency_probe": {"10 Mbit/s": {k: {"elements": 1, "ops": probe_ops,
                                                "times_s": [own + probe, own + 2 * probe, own + probe / 2],
                                                "median_s": own + probe, "min_s": own + probe / 2}
                                            for k in link.PROBES}},
            "rows": [{"model": "cnn", "method": "identity", "ops": ops_id},
                     {"model": "cnn", "method": "topk(0.01)", "ops": ops_tk}],
            "measurements": meas}


def test_report_puts_predictions_beside_measurements(tmp_path):
    n, rate = 2, 10e6 / 8
    want_id = link.predicted_wire_bytes(_raw(0, 0, 1, 1)["rows"][0]["ops"], n)
    want_tk = link.predicted_wire_bytes(_raw(0, 0, 1, 1)["rows"][1]["ops"], n)
    comm_id = want_id / rate  # the shared loopback: a collective's time is its wire bytes over the rate
    report = link.build_report([_raw(want_id, int(want_tk * 1.2), 0.01 + comm_id, 0.02)], ["--quick"], 1.0,
                               link.provenance([0.5, 0.5, 0.5]))
    r_id, r_tk = report["rows"]
    assert math.isclose(r_id["kernel_bytes"], want_id) and math.isclose(r_id["bytes_ratio"], 1.0)  # idle came off
    assert math.isclose(r_tk["bytes_ratio"], 1.2, rel_tol=1e-3)
    assert math.isclose(r_id["predicted_comm_s"], comm_id, rel_tol=1e-9)
    assert math.isclose(r_id["step_s"], 0.01 + comm_id) and math.isclose(r_id["time_ratio"], 1.0, rel_tol=1e-9)
    assert math.isclose(r_tk["speedup"], (0.01 + comm_id) / 0.02)
    assert not report["checks"]["bytes_within_10pct"] and math.isclose(report["checks"]["max_bytes_error"], 0.2,
                                                                        rel_tol=1e-3)
    assert report["checks"]["time_rows_at_10_100"] == 2 and len(report["misses"]) == 2 - report["checks"][
        "time_rows_within_25pct_at_10_100"]
    link.write(report, tmp_path)
    md = (tmp_path / "link.md").read_text()
    assert md.startswith("<!-- generated by python -m experiments.benchmarks.link --quick -->\nMeasured with `sudo")
    assert "| 2 | cnn | topk(0.01) | 10 Mbit/s | 2 |" in md and "1.200" in md and "load average" in md
    assert json.loads((tmp_path / "link.json").read_text())["rows"][0]["method"] == "identity"
    assert (tmp_path / "link.png").stat().st_size > 0


def test_a_step_runs_from_its_last_start_to_its_last_end():
    """Step durations from every process's [start, end] of each step, whoever started late or ran ahead."""
    marks = [[[0.000, 0.010], [0.020, 0.045]],   # process 0
             [[0.002, 0.014], [0.021, 0.040]]]   # process 1: started step 1 last, finished step 2 first
    # step 1: max end 0.014 - max start 0.002; step 2: 0.045 - 0.021
    assert link.global_steps(marks) == pytest.approx([0.012, 0.024])
    with pytest.raises(ValueError, match="same number"):
        link.global_steps([[[0.0, 1.0]], []])


def test_window_is_planned_from_the_audited_bytes():
    args = argparse.Namespace(min_steps=3, max_steps=12, window_s=0.5, warmup=1)
    dense = [{"op": "all-reduce", "operands": [["f32", [206922]]], "bytes": 827688}]
    # 1.73 MB at 10 Mbit/s: 1.39 s a step: the fewest steps, no warm-up
    assert link.window(dense, 2, 10e6, "identity", args) == (3, 0)
    # 139 ms at 100 Mbit/s + 20 ms: ceil(0.5 / 0.159) = 4 steps and a warm-up
    assert link.window(dense, 2, 100e6, "identity", args) == (4, 1)
    assert link.window(dense, 2, None, "identity", args) == (12, 1)  # unshaped: the most
    assert link.window(dense, 2, 10e6, "diloco(H=50)", args) == (50, 1)  # DiLoCo: its window


def test_call_latency_is_the_probes_mean_call_and_each_call_takes_the_longer_of_it_and_its_bytes():
    """α = the mean probe call less its own bytes; every gloo call (one per operand) costs max(α, wire / R)."""
    run = _raw(1000, 100, 0.5, 0.05, compute=0.01, probe=3e-3)
    alpha = 3e-3 * (1 + 2 + 0.5) / 3  # the probe's calls less their own wire bytes at 10 Mbit/s: 3, 6, 1.5 ms
    assert math.isclose(link.probe_latency(run), alpha)
    report = link.build_report([run], [], 1.0, link.provenance([0.5, 0.5, 0.5]))
    assert math.isclose(report["call_latency_s"]["2"], alpha)
    rate = 10e6 / 8
    vote = 2 * (4 + 48 + 66 + 2 * (48 + 66) + 33)  # 2 messages of 4 bytes: 758 wire bytes, 0.6 ms < alpha
    assert netmodel.wire_bytes("all-reduce", 4, 2) == vote
    grads = netmodel.wire_bytes("all-reduce", 4000, 2)  # 8,760 bytes: 7.0 ms > alpha
    values = netmodel.wire_bytes("all-gather", 40, 2)  # 4 half-messages: 1.4 ms < alpha
    want = {"identity": max(alpha, vote / rate) + max(alpha, grads / rate),
            "topk(0.01)": max(alpha, vote / rate) + 2 * max(alpha, values / rate)}
    assert want["identity"] == alpha + grads / rate and want["topk(0.01)"] == 3 * alpha
    for r in report["rows"]:
        assert r["calls"] == {"identity": 2, "topk(0.01)": 3}[r["method"]]
        assert math.isclose(r["predicted_comm_s"], want[r["method"]])
        assert math.isclose(r["predicted_no_overlap_s"], 0.01 + want[r["method"]])


def test_not_permitted_says_so_in_one_line_and_exits_0(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(link.shutil, "which", lambda tool: None if tool == "unshare" else "/usr/bin/" + tool)
    assert link.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "skipped" in out[0] and "unshare" in out[0]
    assert not list(tmp_path.iterdir())  # no table


PUBLISHED = Path(link.PUBLISHED) / "link.json"


@pytest.mark.skipif(not PUBLISHED.exists(), reason="the committed benchmark results are not there")
def test_committed_results_are_todays_model():
    """The committed table's predictions are what the model gives now for the audited collectives it recorded."""
    report = json.loads(PUBLISHED.read_text())
    rows = iter(report["rows"])
    for run in report["raw"]:
        ops = {(r["model"], r["method"]): r["ops"] for r in run["rows"]}
        for m in run["measurements"]:
            row = next(rows)
            every = link.syncs_per_step(m["method"])
            want = link.predict(ops[(m["model"], m["method"])], run["processes"], m["bits_per_s"], row["compute_s"],
                                m["method"], report["call_latency_s"][str(run["processes"])])
            assert row["predicted_wire_bytes"] == link.predicted_wire_bytes(ops[(m["model"], m["method"])],
                                                                            run["processes"]) * every
            assert math.isclose(row["predicted_no_overlap_s"], want["no_overlap_s"])
            assert math.isclose(row["kernel_bytes"], link.kernel_bytes_per_step(m))
    assert {r["processes"] for r in report["rows"]} == {2, 4}


@pytest.mark.slow  # a measured link
def test_short_real_measurement(tmp_path):
    """2 processes, dense CNN, 100 Mbit/s, 3 steps: the kernel's bytes within 10% of the prediction."""
    why = link.permitted()
    if why is not None:
        pytest.skip(f"needs a network namespace and tc: {why}")
    assert link.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "link.json").read_text())
    (row,) = report["rows"]
    assert (row["processes"], row["method"], row["rate"]) == (2, "identity", "100 Mbit/s")
    assert row["payload_bytes_per_worker"] == 827_692  # the CNN's float32 gradients + the 4-byte vote
    assert abs(row["bytes_ratio"] - 1) < 0.10, row
    assert row["dropped"] == 0
