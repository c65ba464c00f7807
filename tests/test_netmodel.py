"""The alpha-beta model against hand-computed costs, and bad input."""

import math

import pytest

from compjax import netmodel
from compjax.accounting import Collective


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


def test_one_worker_costs_nothing_and_step_time_sums():
    net = netmodel.Network(1e9, 1e-6)
    assert netmodel.allreduce_time(1e9, 1, net) == 0.0
    ops = [Collective("all-reduce", (("f32", (100,)),), 400, "a"), Collective("all-gather", (("s32", (10,)),), 40, "b")]
    want = netmodel.allreduce_time(400, 4, net) + netmodel.allgather_time(40, 4, net)
    assert math.isclose(netmodel.step_time(ops, 4, net), want)
    # compression pays: the sparse step is cheaper than the dense one at equal workers
    assert netmodel.step_time(ops[1:], 4, net) < netmodel.step_time(ops[:1], 4, net)


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
