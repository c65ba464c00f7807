"""The alpha-beta model against hand-computed costs, the step prediction, the audited bytes it uses, and bad input."""

import math
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import netmodel, parallel
from compjax.accounting import Collective
from compjax.netmodel import Network


def test_allreduce_ring_formula():
    net = netmodel.Network(bandwidth=1e9, latency=1e-5)
    # 8 workers, 80 MB: 2*7 messages of 10 MB each
    t = netmodel.allreduce_time(80e6, 8, net)
    assert math.isclose(t, 14 * (1e-5 + 10e6 / 1e9))


def test_allgather_and_parameter_server():
    net = netmodel.Network.from_gbit(8.0, latency_us=0.0)  # 1e9 bytes/s
    assert math.isclose(net.bandwidth, 1e9)
    assert math.isclose(netmodel.allgather_time(1e6, 4, net), 3e-3)
    assert math.isclose(netmodel.parameter_server_time(1e6, 4, net), 8e-3)
    assert math.isclose(netmodel.parameter_server_time(1e6, 4, net, result_bytes=0), 4e-3)


# 64 MB per worker over 1e9 B/s links with 10 us per message, worked out by hand:
#   all-reduce  2(n-1) * 10us + 2(n-1)/n * 0.064 s
#   all-gather  (n-1) * 10us + (n-1) * 0.064 s
#   param. server  2 * 10us + n * 2 * 0.064 s
HAND = {
    2: {"all-reduce": 0.00002 + 0.064, "all-gather": 0.00001 + 0.064, "parameter-server": 0.00002 + 0.256},
    8: {"all-reduce": 0.00014 + 0.112, "all-gather": 0.00007 + 0.448, "parameter-server": 0.00002 + 1.024},
    64: {"all-reduce": 0.00126 + 0.126, "all-gather": 0.00063 + 4.032, "parameter-server": 0.00002 + 8.192},
}


@pytest.mark.parametrize("n", sorted(HAND))
@pytest.mark.parametrize("kind", ["all-reduce", "all-gather", "parameter-server"])
def test_formulas_by_hand(n, kind):
    net = Network(1e9, 1e-5)
    assert math.isclose(netmodel.collective_time(kind, 64e6, n, net), HAND[n][kind], rel_tol=1e-12)


def test_one_worker_costs_nothing_and_step_time_sums():
    net = netmodel.Network(1e9, 1e-6)
    assert netmodel.allreduce_time(1e9, 1, net) == 0.0
    ops = [Collective("all-reduce", (("f32", (100,)),), 400, "a"), Collective("all-gather", (("s32", (10,)),), 40, "b")]
    want = netmodel.allreduce_time(400, 4, net) + netmodel.allgather_time(40, 4, net)
    assert math.isclose(netmodel.step_time(ops, 4, net), want)
    # compression pays: the sparse step is cheaper than the dense one at equal workers
    assert netmodel.step_time(ops[1:], 4, net) < netmodel.step_time(ops[:1], 4, net)


# --------------------------------------------------------------------------- presets


def test_presets():
    presets = Network.presets()
    assert set(presets) == {"ethernet_1g", "ethernet_10g", "infiniband_100g", "infiniband_400g", "nvlink",
                            "tpu_dcn", "wan"}
    for name, net in presets.items():
        assert getattr(Network, name) is net and net.name == name
        assert net.bandwidth > 0 and net.latency > 0
    # bytes per second, not bits
    assert Network.ethernet_1g.bandwidth == 125e6 and Network.ethernet_10g.bandwidth == 1.25e9
    assert Network.infiniband_100g.bandwidth == 12.5e9 and Network.infiniband_400g.bandwidth == 50e9
    assert Network.tpu_dcn.bandwidth == 6.25e9 and Network.nvlink.bandwidth == 450e9
    assert Network.wan.bandwidth == 12.5e6 and Network.wan.latency == 0.11
    # faster links, lower per-message cost
    assert Network.ethernet_1g.latency > Network.ethernet_10g.latency > Network.infiniband_100g.latency
    # the old positional form still works, with an empty name
    assert Network(1e9, 1e-6) == Network(bandwidth=1e9, latency=1e-6, name="")
    assert Network.from_gbit(10, 20, name="x") == Network(1.25e9, 20e-6, "x")
    assert Network(1.25e9, 2e-5).label == "10 Gbit/s, 20 us" and Network.wan.label == "wan"


#: The table of presets in ``Network``'s docstring, as written there: (bandwidth, latency).
DOCUMENTED = {
    "ethernet_1g": ("1 Gbit/s", "50 us"),
    "ethernet_10g": ("10 Gbit/s", "20 us"),
    "infiniband_100g": ("100 Gbit/s", "5 us"),
    "infiniband_400g": ("400 Gbit/s", "5 us"),
    "nvlink": ("450 GB/s", "3 us"),
    "tpu_dcn": ("50 Gbit/s", "25 us"),
    "wan": ("100 Mbit/s", "110 ms"),
}
UNITS = {"Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "GB/s": 1e9, "us": 1e-6, "ms": 1e-3}  # -> bytes/s, seconds


def test_every_preset_is_the_documented_table():
    """Each preset's bandwidth (bytes/s) and latency (s) equal the docstring's table, and the table is the one above."""
    def value(text):
        number, unit = text.split()
        return float(number) * UNITS[unit]

    presets = Network.presets()
    assert set(presets) == set(DOCUMENTED)
    for name, (bandwidth, latency) in DOCUMENTED.items():
        net = presets[name]
        assert math.isclose(net.bandwidth, value(bandwidth), rel_tol=1e-12), (name, net.bandwidth, bandwidth)
        assert math.isclose(net.latency, value(latency), rel_tol=1e-12), (name, net.latency, latency)
    rows = re.findall(r"^\s*``(\w+)``\s+(\d+ \S+)\s+(\d+ \S+)\s", Network.__doc__, re.MULTILINE)
    assert {name: (bw, lat) for name, bw, lat in rows} == DOCUMENTED


# --------------------------------------------------------------------------- predict_step

AR80 = [Collective("all-reduce", (("f32", (20_000_000,)),), 80_000_000, "ar")]


def test_predict_step_by_hand():
    # 8 workers, 1e9 B/s, 10 us: comm = 14 * 10us + 1.75 * 80e6 / 1e9 = 0.00014 + 0.14
    p = netmodel.predict_step(AR80, 8, Network(1e9, 1e-5), compute_s=0.2)
    assert math.isclose(p.comm_s, 0.14014)
    assert math.isclose(p.no_overlap_s, 0.34014)
    assert math.isclose(p.overlap_s, 0.2)
    assert math.isclose(p.comm_fraction, 0.14014 / 0.34014)
    # 1.4e8 bytes' worth of time must fit in 0.2 - 0.00014 s
    assert math.isclose(p.hiding_bandwidth, 1.4e8 / 0.19986)
    assert math.isclose(netmodel.predict_step(AR80, 8, Network(p.hiding_bandwidth, 1e-5), 0.2).comm_s, 0.2)
    # communication longer than compute: overlap is bounded by communication
    q = netmodel.predict_step(AR80, 8, Network(1e9, 1e-5), compute_s=0.1)
    assert math.isclose(q.overlap_s, 0.14014) and math.isclose(q.no_overlap_s, 0.24014)
    assert math.isclose(q.hiding_bandwidth, 1.4e8 / 0.09986)
    assert p._fields == ("compute_s", "comm_s", "no_overlap_s", "overlap_s", "comm_fraction", "hiding_bandwidth")


def test_predict_step_hiding_bandwidth_inf_and_zero():
    # 64 workers, 10 ms per message: 126 messages = 1.26 s of latency > 1 s of compute
    assert netmodel.predict_step(AR80, 64, Network(1e9, 0.01), compute_s=1.0).hiding_bandwidth == math.inf
    assert netmodel.predict_step(AR80, 2, Network(1e9, 0.25), compute_s=0.5).hiding_bandwidth == math.inf  # equal
    assert netmodel.predict_step(AR80, 8, Network(1e9), compute_s=0.0).hiding_bandwidth == math.inf
    # nothing to send: no collectives, empty ones, or one worker
    for ops, n in (([], 8), ([AR80[0]._replace(bytes=0)], 8), (AR80, 1)):
        p = netmodel.predict_step(ops, n, Network(1e9), compute_s=0.1)
        assert p.hiding_bandwidth == 0.0 and p.comm_s == 0.0 and p.overlap_s == 0.1 and p.comm_fraction == 0.0
    p = netmodel.predict_step([], 8, Network(1e9), compute_s=0.0)
    assert p == (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"network": Network(0.0)}, "bandwidth"),
        ({"network": Network(-1.0)}, "bandwidth"),
        ({"network": Network(1e9, -1e-6)}, "latency"),
        ({"compute_s": -0.1}, "compute_s"),
        ({"workers": 0}, "workers"),
        ({"workers": 2.5}, "workers"),
    ],
)
@pytest.mark.parametrize("ops", [[], AR80])
def test_predict_step_bad_input(kwargs, name, ops):
    args = {"collectives": ops, "workers": 8, "network": Network(1e9), "compute_s": 0.1, **kwargs}
    with pytest.raises(ValueError, match=name):
        netmodel.predict_step(**args)


def test_predict_step_unknown_collective():
    with pytest.raises(ValueError, match="kind"):
        netmodel.predict_step([Collective("all-to-all", (), 10, "x")], 8, Network(1e9), 0.1)


# --------------------------------------------------------------------------- the model's bytes are the audited ones


@pytest.mark.parametrize("make", [lambda: cj.topk(0.1, axis_name="data"),
                                  pytest.param(lambda: cj.powersgd(2, axis_name="data"),
                                               marks=pytest.mark.slow)],
                         ids=["topk", "powersgd"])
def test_prediction_uses_the_audited_bytes_of_a_compiled_step(mesh, make):
    tx = optax.chain(make(), optax.sgd(0.1))  # with the non-finite vote: an all-reduce next to the exchange
    params = {"w": jnp.zeros((20, 50)), "b": jnp.zeros((50,))}

    def loss(p, x):
        return jnp.mean((x @ p["w"] + p["b"] - 1.0) ** 2)

    step = parallel.data_parallel_step(loss, tx, mesh)
    p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
    x = parallel.shard_batch(jnp.ones((4 * mesh.size, 20)), mesh)
    ops = cj.audit_collectives(step, p, s, x)
    assert {c.op for c in ops} <= {"all-reduce", "all-gather"} and len(ops) >= 2
    n, net, compute = mesh.size, Network(1e8, 2e-5), 0.003
    pred = netmodel.predict_step(ops, n, net, compute)
    by_hand = 0.0
    for c in ops:  # the formulas written out again, over the audited bytes
        if c.op == "all-reduce":
            by_hand += 2 * (n - 1) * (net.latency + c.bytes / n / net.bandwidth)
        else:
            by_hand += (n - 1) * (net.latency + c.bytes / net.bandwidth)
    assert math.isclose(pred.comm_s, by_hand)
    _, s, _ = step(p, s, x)
    sent = cj.payload_bytes(s)
    assert np.all(sent == sum(c.bytes for c in ops))
    # compare() reports the same bytes and times
    (row,) = netmodel.compare({"x": ops}, n, net, compute, baseline=None)
    assert row["bytes"] == int(sent[0]) and math.isclose(row["comm_s"], by_hand)


# --------------------------------------------------------------------------- measure_compute_time


def test_measure_compute_time_is_the_median_after_warmup(monkeypatch):
    calls = []
    ticks = iter([10.0, 11.0, 20.0, 26.0, 30.0, 32.0])  # durations 1, 6, 2: median 2, mean 3

    monkeypatch.setattr(netmodel.time, "perf_counter", lambda: next(ticks))
    t = netmodel.measure_compute_time(lambda a, b=0: calls.append((a, b)) or jnp.zeros(()), 1, b=2, repeats=3,
                                      warmup=2)
    assert t == 2.0
    assert calls == [(1, 2)] * 5  # 2 warm-up calls (not timed) + 3 timed


def test_measure_compute_time_runs_and_validates():
    assert netmodel.measure_compute_time(lambda x: x + 1, jnp.ones(3), repeats=2) >= 0.0
    with pytest.raises(ValueError, match="repeats"):
        netmodel.measure_compute_time(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        netmodel.measure_compute_time(lambda: None, warmup=-1)


# --------------------------------------------------------------------------- compare and to_markdown

DENSE = [Collective("all-reduce", (), 4_000_000, "ar")]
SPARSE = [Collective("all-gather", (), 100_000, "i"), Collective("all-gather", (), 100_000, "v")]


def test_compare_rows_and_speedups():
    nets = [Network.ethernet_1g, Network.ethernet_10g]
    rows = netmodel.compare({"identity": DENSE, "topk": SPARSE}, 8, nets, 0.1)
    assert [(r["compressor"], r["network"], r["workers"]) for r in rows] == [
        ("identity", "ethernet_1g", 8), ("identity", "ethernet_10g", 8),
        ("topk", "ethernet_1g", 8), ("topk", "ethernet_10g", 8)]
    assert [r["bytes"] for r in rows] == [4_000_000, 4_000_000, 200_000, 200_000]
    # 1 GbE: dense 14 * 50us + 1.75 * 4e6 / 125e6 = 0.0007 + 0.056; sparse 2 * (7 * 50us + 7 * 1e5 / 125e6)
    dense_1g, sparse_1g = 0.0007 + 0.056, 2 * (0.00035 + 0.0056)
    assert math.isclose(rows[0]["comm_s"], dense_1g) and math.isclose(rows[2]["comm_s"], sparse_1g)
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] == 1.0
    assert math.isclose(rows[2]["speedup"], (0.1 + dense_1g) / (0.1 + sparse_1g))
    assert math.isclose(rows[2]["speedup_overlap"], 1.0)  # both hidden behind 100 ms of compute
    assert math.isclose(rows[2]["no_overlap_s"], 0.1 + sparse_1g) and rows[2]["overlap_s"] == 0.1
    # all-gathers lose their edge as workers grow: at 64 workers top-k's 20x fewer bytes cost more than dense
    rows = netmodel.compare({"identity": DENSE, "topk": SPARSE}, [8, 64], Network(1e9), 0.0)
    speed = {(r["compressor"], r["workers"]): r["speedup"] for r in rows}
    assert math.isclose(speed["topk", 8], 7 / 1.4) and math.isclose(speed["topk", 64], (126 / 64 * 4) / (63 * 0.2))
    assert speed["topk", 64] < 1 < speed["topk", 8]


def test_compare_networks_mapping_compute_mapping_and_no_baseline():
    rows = netmodel.compare({"a": DENSE, "b": SPARSE}, 4, {"lan": Network(1e9)}, {"a": 0.1, "b": 0.2}, baseline=None)
    assert [r["network"] for r in rows] == ["lan", "lan"] and "speedup" not in rows[0]
    assert [r["compute_s"] for r in rows] == [0.1, 0.2]
    rows = netmodel.compare({"a": DENSE}, 4, Network.wan, 0.1, baseline="a")
    assert rows[0]["network"] == "wan" and rows[0]["speedup"] == 1.0


def test_compare_bad_input():
    with pytest.raises(ValueError, match="baseline"):
        netmodel.compare({"topk": SPARSE}, 8, Network(1e9), 0.1)
    with pytest.raises(ValueError, match="compute_s"):
        netmodel.compare({"identity": DENSE, "topk": SPARSE}, 8, Network(1e9), {"identity": 0.1})
    with pytest.raises(ValueError, match="networks"):
        netmodel.compare({"identity": DENSE}, 8, "ethernet_1g", 0.1)
    with pytest.raises(ValueError, match="workers"):
        netmodel.compare({"identity": DENSE}, 0, Network(1e9), 0.1)


def test_to_markdown():
    rows = netmodel.compare({"identity": DENSE, "topk": SPARSE}, 8, [Network.ethernet_1g], 0.1)
    md = netmodel.to_markdown(rows)
    lines = md.strip().split("\n")
    assert len(lines) == 2 + len(rows)
    assert lines[0].startswith("| compressor | network | workers | bytes/step/worker | compute (ms) | comm (ms) |")
    assert lines[2].startswith("| identity | ethernet_1g | 8 | 4,000,000 | 100.0 | 56.7 |")
    assert "| 1.00× |" in lines[2] and lines[3].startswith("| topk | ethernet_1g | 8 | 200,000 |")
    assert netmodel.to_markdown([]) == ""


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: netmodel.allreduce_time(-1, 4, netmodel.Network(1e9)), "nbytes"),
        (lambda: netmodel.allreduce_time(1, 0, netmodel.Network(1e9)), "workers"),
        (lambda: netmodel.allreduce_time(1, 4, netmodel.Network(0.0)), "bandwidth"),
        (lambda: netmodel.allreduce_time(1, 4, netmodel.Network(1e9, -1)), "latency"),
        (lambda: netmodel.collective_time("broadcast", 1, 4, netmodel.Network(1e9)), "kind"),
    ],
)
def test_bad_input(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# gloo's messages and their framing: what a collective puts on the wire.


def _ring_allreduce_reference(nbytes: int, n: int, eb: int) -> tuple[list[int], np.ndarray]:
    """Run gloo's ring schedule on NumPy buffers: the messages it sends, and the reduced buffers it leaves.

    Written from ``gloo/allreduce.cc`` (``ring``): rank r receives from r + 1 and sends to r - 1;
    reduce-scatter sends segment ``(r + 1) * per_rank + i`` and adds the received one at
    ``(r + 2) * per_rank + i``; all-gather sends ``r * per_rank + i`` and stores ``(r + 1) * per_rank + i``.
    """
    elems = nbytes // eb
    rng = np.random.default_rng(nbytes + n)
    data = rng.integers(0, 100, size=(n, elems)).astype(np.int64)
    want = data.sum(0)
    seg_max = 1024 * 1024 // eb
    num = max(-(-elems // seg_max), 2 * n)
    num = -(-num // n) * n
    per_rank = num // n
    seg = -(-elems // num)  # elements per segment
    buf = data.copy()
    sizes = []

    def span(k):
        start = (k % num) * seg
        return start, min(start + seg, elems)

    for phase in ("rs", "ag"):
        for i in range(num - per_rank):
            sends = []
            for r in range(n):
                k = ((r + 1) * per_rank + i) if phase == "rs" else (r * per_rank + i)
                a, b = span(k)
                if b > a:
                    sends.append((r, a, b, buf[r, a:b].copy()))
            for r, a, b, chunk in sends:  # rank r sends to r - 1
                dst = (r - 1) % n
                sizes.append((b - a) * eb)
                if phase == "rs":
                    buf[dst, a:b] += chunk
                else:
                    buf[dst, a:b] = chunk
    assert np.array_equal(buf, np.broadcast_to(want, buf.shape)), "the schedule is not an all-reduce"
    return sizes, buf


@pytest.mark.parametrize("nbytes,n", [(4, 2), (4, 4), (12, 4), (827_688, 2), (827_688, 4), (450_052, 4),
                                      (6 * 1024 * 1024 + 8, 3)])
def test_gloo_ring_allreduce_messages_match_a_simulated_ring(nbytes, n):
    sizes, _ = _ring_allreduce_reference(nbytes, n, 4)
    assert sorted(netmodel.gloo_messages("all-reduce", nbytes, n, 4)) == sorted(sizes)
    assert sum(sizes) == 2 * (n - 1) * nbytes  # the textbook ring's traffic
    assert netmodel.wire_bytes("all-reduce", nbytes, n, netmodel.Framing.none) == 2 * (n - 1) * nbytes


def test_gloo_allgather_and_message_counts():
    assert netmodel.gloo_messages("all-gather", 851, 3) == [425, 426] * 6  # each worker sends n - 1 blocks in halves
    assert netmodel.wire_bytes("all-gather", 852, 4, netmodel.Framing.none) == 4 * 3 * 852
    assert len(netmodel.gloo_messages("all-reduce", 827_688, 2)) == 8  # 2n segments, (n-1)/n of them per phase
    assert len(netmodel.gloo_messages("all-reduce", 4, 4)) == 6  # one 4-byte element: 2 (n-1) messages
    assert netmodel.gloo_messages("all-reduce", 1 << 20, 1) == []
    with pytest.raises(ValueError, match="kind"):
        netmodel.gloo_messages("reduce-scatter", 4, 2)
    with pytest.raises(ValueError, match="workers"):
        netmodel.wire_bytes("all-reduce", 4, 0)


def test_gloo_tcp_framing_by_hand():
    f = netmodel.Framing.gloo_tcp
    control = 2 * (48 + 66) + 33  # NOTIFY_SEND_READY and NOTIFY_RECV_READY, one segment each; half an acknowledgement
    assert f.message_bytes(0) == 48 + 66 + control
    assert f.message_bytes(1400) == 1448 + 66 + control  # payload + preamble fill one segment
    assert f.message_bytes(1401) == 1449 + 2 * 66 + control
    assert netmodel.Framing.none.message_bytes(1401) == 1401
    # a dense CNN all-reduce at P = 2: 8 messages of 206,922 bytes, 143 segments each
    assert netmodel.wire_bytes("all-reduce", 827_688, 2) == 2 * 827_688 + 8 * (48 + 143 * 66 + control)


# --------------------------------------------------------------------------- one shared medium; framing in the time

# 4 workers, 1 MB each, 1e8 B/s, 0.1 ms per message, worked out by hand.  Per-worker links: a ring's n links carry
# its messages side by side.  One shared medium (a loopback, an uplink): all of them queue on the one link.
#   all-reduce   links 6 * 0.1ms + 2*3/4 * 1e6 / 1e8 = 0.0006 + 0.015   shared 0.0006 + 6 * 0.01 = 0.0606
#   all-gather   links 3 * 0.1ms + 3 * 1e6 / 1e8     = 0.0003 + 0.03    shared 0.0003 + 12 * 0.01 = 0.1203
#   param. server  2 * 0.1ms + 4 * 2e6 / 1e8 = 0.0802 either way (the server's link carries everything)
SHARED_HAND = {"all-reduce": (0.0156, 0.0606), "all-gather": (0.0303, 0.1203), "parameter-server": (0.0802, 0.0802)}


@pytest.mark.parametrize("kind", sorted(SHARED_HAND))
def test_shared_medium_by_hand(kind):
    links, shared = SHARED_HAND[kind]
    assert math.isclose(netmodel.collective_time(kind, 1e6, 4, Network(1e8, 1e-4)), links, rel_tol=1e-12)
    assert math.isclose(netmodel.collective_time(kind, 1e6, 4, Network(1e8, 1e-4, shared=True)), shared,
                        rel_tol=1e-12)
    assert netmodel.collective_time(kind, 1e6, 1, Network(1e8, 1e-4, shared=True)) == 0.0


def test_shared_network_fields_and_label():
    net = Network.from_gbit(0.1, 100, shared=True)
    assert net == Network(12.5e6, 1e-4, "", True) and net.shared and not Network(1e9).shared
    assert net.label == "0.1 Gbit/s, 100 us, shared"


def test_framed_time_by_hand():
    """With a framing, each collective's bytes take their wire bytes' time: gloo's messages with their headers."""
    f, net = netmodel.Framing.gloo_tcp, Network(12.5e6, 1e-4, shared=True)  # 100 Mbit/s shared, 0.1 ms
    # the dense CNN all-reduce at n = 2 (see test_gloo_tcp_framing_by_hand): 1,733,352 wire bytes, 2 messages
    assert math.isclose(netmodel.collective_time("all-reduce", 827_688, 2, net, f), 2e-4 + 1_733_352 / 12.5e6)
    # per-worker links: the two links carry half of it each
    assert math.isclose(netmodel.collective_time("all-reduce", 827_688, 2, net._replace(shared=False), f),
                        2e-4 + 1_733_352 / 2 / 12.5e6)
    # a 4-byte vote at n = 4: 6 messages of 4 bytes, each 48 + 66 + 2 (48 + 66) + 33 = 375 wire bytes
    vote = 6 * (4 + 48 + 66 + 2 * (48 + 66) + 33)
    assert netmodel.wire_bytes("all-reduce", 4, 4) == vote
    assert math.isclose(netmodel.collective_time("all-reduce", 4, 4, net, f), 6e-4 + vote / 12.5e6)
    assert netmodel.collective_time("all-reduce", 0, 4, net, f) == 0.0
    # an audited collective of two operands is two gloo calls, each with its latency and its own framing
    two = Collective("all-reduce", (("f32", (186,)), ("f32", (372,))), 2232, "p")
    want = (netmodel.collective_time("all-reduce", 744, 4, net, f) + netmodel.collective_time("all-reduce", 1488, 4, net, f))
    assert math.isclose(netmodel.step_time([two], 4, net, f), want)
    assert math.isclose(netmodel.predict_step([two], 4, net, 0.01, framing=f).comm_s, want)
    # without framing the record is one collective of its payload, as before
    assert math.isclose(netmodel.step_time([two], 4, net), netmodel.allreduce_time(2232, 4, net))
    with pytest.raises(ValueError, match="dtype"):
        netmodel.step_time([Collective("all-reduce", (("c64", (2,)),), 16, "x")], 4, net, f)


# --------------------------------------------------------------------------- a cost per call, overlapping its bytes

# 2 ms per call, 0.1 ms per message, 1e8 B/s shared by 2 workers, worked out by hand (LogP: a call is bound by the
# hosts' overhead or by the link, whichever is longer):
#                         with the call latency                          without (the textbook sum)
#   all-reduce of 1 MB    2 * 0.1ms + max(2 ms, 2 * 1e6 / 1e8 = 20 ms)   = 0.0202     0.0002 + 0.02  = 0.0202
#   all-reduce of 10 kB   2 * 0.1ms + max(2 ms, 2 * 1e4 / 1e8 = 0.2 ms)  = 0.0022     0.0002 + 0.0002 = 0.0004
#   all-gather of 50 kB   1 * 0.1ms + max(2 ms, 2 * 5e4 / 1e8 = 1 ms)    = 0.0021     0.0001 + 0.001 = 0.0011
#   param. server 100 kB  2 * 0.1ms + max(2 ms, 2 * 2e5 / 1e8 = 4 ms)    = 0.0042     0.0002 + 0.004 = 0.0042
CALL = Network(1e8, 1e-4, shared=True, call_latency=2e-3)
CALL_HAND = [("all-reduce", 1e6, 0.0202, 0.0202), ("all-reduce", 1e4, 0.0022, 0.0004),
             ("all-gather", 5e4, 0.0021, 0.0011), ("parameter-server", 1e5, 0.0042, 0.0042)]


@pytest.mark.parametrize("kind,nbytes,want,textbook", CALL_HAND)
def test_call_latency_by_hand(kind, nbytes, want, textbook):
    assert math.isclose(netmodel.collective_time(kind, nbytes, 2, CALL), want, rel_tol=1e-12)
    assert math.isclose(netmodel.collective_time(kind, nbytes, 2, CALL._replace(call_latency=0.0)), textbook,
                        rel_tol=1e-12)
    assert netmodel.collective_time(kind, nbytes, 1, CALL) == 0.0  # one worker: no call at all


def test_call_latency_in_a_step_and_its_hiding_bandwidth():
    """Each record (each operand, with a framing) is a call; the hiding bandwidth solves comm(B) = compute."""
    ops = [Collective("all-reduce", (("f32", (250_000,)),), 1_000_000, "g"), Collective("all-reduce", (), 4, "v")]
    assert math.isclose(netmodel.step_time(ops, 2, CALL), 0.0202 + 0.0022)  # the vote pays a whole call
    p = netmodel.predict_step(ops, 2, CALL, compute_s=0.05)
    assert math.isclose(p.comm_s, 0.0224) and math.isclose(p.no_overlap_s, 0.0724)
    # at the hiding bandwidth the step's communication takes exactly its compute time
    assert math.isclose(netmodel.step_time(ops, 2, CALL._replace(bandwidth=p.hiding_bandwidth)), 0.05, rel_tol=1e-9)
    # by hand: 0.4 ms of messages + the vote's 2 ms + 2e6 / B = 50 ms  ->  B = 2e6 / 0.0476
    assert math.isclose(p.hiding_bandwidth, 2e6 / 0.0476, rel_tol=1e-9)
    # a call latency at least the compute time: no bandwidth hides it
    assert netmodel.predict_step(ops, 2, CALL._replace(call_latency=0.03), 0.05).hiding_bandwidth == math.inf
    with pytest.raises(ValueError, match="call_latency"):
        netmodel.predict_step(ops, 2, CALL._replace(call_latency=-1.0), 0.05)
    assert Network(1e9, call_latency=2e-3).label == "8 Gbit/s, 0 us + 2000 us per call"
