"""MultiProcessTransport between hosts: any TCP endpoint, and transfer servers bound to the advertised addresses.

Linux routes the whole of 127.0.0.0/8 to the loopback interface, so 127.0.0.2 and 127.0.0.3 stand for two other
machines: a server bound to 127.0.0.2 is not reachable at 127.0.0.1, and every pull names the address it
pulled from.  The multi-process test runs tests/decoupled_procs.py (as tests/test_decoupled_multiprocess.py does).
"""

from __future__ import annotations

import json
import re
import socket
import sys

import numpy as np
import pytest

from tests.test_decoupled_multiprocess import PHASE_S, START_S, load, start

pytest.importorskip("zmq")


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.p.poll() is None:
            p.p.kill()
            p.p.wait()
        p._file.close()

LOOPBACK_ONLY = not sys.platform.startswith("linux")


def free_address(host: str) -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def test_endpoints_and_advertised_hosts_are_checked():
    from compjax.decoupled import MultiProcessTransport
    from compjax.decoupled.multiprocess import parse_endpoint

    assert parse_endpoint("tcp://10.1.2.3:5555", bind=False) == ("10.1.2.3", 5555)
    assert parse_endpoint("tcp://host-a.example:5555", bind=False) == ("host-a.example", 5555)
    assert parse_endpoint("tcp://*:0", bind=True) == ("*", 0)
    assert parse_endpoint("tcp://0.0.0.0:5555", bind=True) == ("0.0.0.0", 5555)
    for bad, bind in [("127.0.0.1:5555", True), ("udp://127.0.0.1:5555", False), ("tcp://127.0.0.1", True),
                      ("tcp://*:5555", False), ("tcp://host-a:5555", True), ("tcp://1.2.3.999:5", False),
                      ("tcp://127.0.0.1:0", False), ("tcp://127.0.0.1:70000", True), (5555, True)]:
        with pytest.raises(ValueError, match="address must be a TCP endpoint"):
            parse_endpoint(bad, bind=bind)
    with pytest.raises(ValueError, match="address"):
        MultiProcessTransport.for_learner("a", "tcp://*:5555")
    for bad in ["0.0.0.0", "host-a", "1.2.3", 7]:
        with pytest.raises(ValueError, match="advertise"):
            MultiProcessTransport.for_syncer(advertise=bad)
    with pytest.raises(ValueError, match="advertise must be an IPv4 address of one of this machine"):
        MultiProcessTransport.for_syncer(advertise="203.0.113.77")  # TEST-NET-3: on no interface here


def test_a_syncer_on_every_interface_advertises_a_reachable_address():
    from compjax.decoupled import MultiProcessTransport

    with pytest.raises(ValueError, match="insecure=True"):  # every interface, no keys: refused unless said
        MultiProcessTransport.for_syncer("tcp://0.0.0.0:0")
    t = MultiProcessTransport.for_syncer("tcp://0.0.0.0:0", insecure=True)
    try:
        port = int(t.address.rsplit(":", 1)[1])
        assert port > 0 and t.advertise != "0.0.0.0" and t.transfer_address.startswith(t.advertise + ":")
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # the ZeroMQ socket listens on lo too
            pass
    finally:
        t.close()


def test_a_learner_advertises_its_route_towards_the_syncer_unless_told():
    from compjax.decoupled import MultiProcessTransport
    from compjax.decoupled.multiprocess import local_address_towards

    assert local_address_towards("127.0.0.2") == "127.0.0.1"  # the loopback's source address
    for advertise, expected in [(None, "127.0.0.1"), ("127.0.0.4", "127.0.0.4")]:
        t = MultiProcessTransport.for_learner("a", "tcp://127.0.0.2:5", advertise=advertise)  # connects lazily
        try:
            assert t.advertise == expected and t.transfer_address.startswith(expected + ":")
        finally:
            t.close()


@pytest.mark.slow
@pytest.mark.skipif(LOOPBACK_ONLY, reason="127.0.0.2 and 127.0.0.3 are loopback addresses only on Linux")
def test_a_round_between_a_syncer_on_127_0_0_2_and_a_learner_advertising_127_0_0_3(tmp_path, procs):
    """The syncer binds tcp://127.0.0.2:PORT and its transfer server 127.0.0.2, the learner advertises
    127.0.0.3: one round is merged, the syncer pulled the contribution from 127.0.0.3, the learner the
    global values and the merged fragment from 127.0.0.2, and nothing from 127.0.0.1."""
    address = free_address("127.0.0.2")
    run = {"name": "hosts", "P": 1, "H": 2, "steps": 4, "comp": "identity", "versions": 2, "address": address}
    base = {"out": str(tmp_path), "learners": ["l0"], "n": 1, "runs": [run], "log_pulls": True}
    syncer = start(procs, "syncer", base, tmp_path / "syncer.log")
    syncer.wait_for("syncer bound", "syncer start-up", timeout=START_S)
    learner = start(procs, "learner", {**base, "name_self": "l0", "index": 0, "advertise": "127.0.0.3"},
                    tmp_path / "l0.log")
    learner.wait_for("learner l0 done hosts", "learner training", timeout=START_S)
    assert learner.exit_code("learner exit") == 0, learner.tail()
    syncer.wait_for("syncer reached 2 hosts", "syncer merges")
    syncer.stop()
    syncer.wait_for("syncer done hosts", "syncer shut-down", timeout=PHASE_S)

    s_log, l_log = syncer.text(), learner.text()
    bound = re.search(r"syncer bound (\S+) transfer (\S+)", s_log)
    assert bound[1] == address and bound[2].startswith("127.0.0.2:"), s_log[-2000:]
    assert re.search(r"learner l0 transfer 127\.0\.0\.3:\d+", l_log), l_log[-2000:]
    syncer_pulls = re.findall(r"pulled from (\S+)", s_log)
    learner_pulls = re.findall(r"pulled from (\S+)", l_log)
    # Two contributions pulled from the learner's server; the welcome and two merged fragments from the syncer's.
    assert len(syncer_pulls) >= 2 and {a.rsplit(":", 1)[0] for a in syncer_pulls} == {"127.0.0.3"}, s_log[-2000:]
    assert len(learner_pulls) >= 3 and set(learner_pulls) == {bound[2]}, l_log[-2000:]
    summary = json.loads((tmp_path / "syncer_hosts.json").read_text())
    assert summary["versions"] == [2] and summary["refused"] == []
    assert [k for _, _, k in summary["merges"]] == [["l0"], ["l0"]]
    # With a single learner and identity, the global model is the learner's anchor: the arrays really arrived.
    anchors = load(tmp_path / "anchor_hosts_l0.npz")
    fragments = load(tmp_path / "fragments_hosts.npz")
    assert len(anchors) == len(fragments) > 0
    for a, f in zip(anchors, fragments):
        np.testing.assert_allclose(a, f, rtol=0, atol=1e-6)
