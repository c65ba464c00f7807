"""The multi-process transport's transfers that fail, in one process (fast): a contribution whose arrays
never arrive is refused within ``pull_timeout_s`` and its learner is not pulled from again until it says
hello; a merged fragment's transfer never stalls the learner's ``poll``."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("zmq")

from compjax.decoupled import (
    MultiProcessTransport,
    Reply,
    Syncer,
    multiprocess,
)
from tests.test_decoupled_syncer import init, message, snapshot


class Never:
    """An array whose values never arrive (a sender killed mid-transfer): ``np.asarray`` blocks until released."""

    def __init__(self, spec, released: threading.Event):
        self.spec, self.released = spec, released

    def __array__(self, dtype=None, copy=None):
        self.released.wait(15)  # the test releases it at its end; a bounded receive gives up before
        return np.zeros(self.spec.shape, self.spec.dtype)


def serve_until(syncer_side, done, timeout=30.0):
    """Run the syncer side's receive loop on this thread until ``done()`` or ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        assert syncer_side.receive(timeout=0.05) is None  # control frames only


def next_incoming(syncer_side, timeout=30.0):
    """The next contribution the syncer side receives."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        incoming = syncer_side.receive(timeout=0.05)
        if incoming is not None:
            return incoming
    raise AssertionError("no contribution arrived")


def join(server, name):
    """A learner side named ``name`` that said hello to ``server`` and got its welcome."""
    lrn = MultiProcessTransport.for_learner(name, server.address, heartbeat_s=0.05)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("start", lrn.join(timeout=30)))
    t.start()
    serve_until(server, lambda: not t.is_alive())
    t.join()
    assert "start" in box
    return lrn


def test_a_contribution_whose_arrays_never_arrive_is_refused_and_its_learner_not_pulled_until_hello(
        monkeypatch, caplog):
    syncer = Syncer(init(), learners=["a"])
    server = MultiProcessTransport.for_syncer(pull_timeout_s=1.0)
    server.attach(syncer)
    lrn = join(server, "a")
    released, transfers = threading.Event(), []

    def never(address, uuid, specs):
        transfers.append(uuid)
        return [Never(s, released) for s in specs]

    try:
        old = snapshot(syncer)
        monkeypatch.setattr(multiprocess, "_transfer", never)
        got = []
        for seed in (1, 2):  # the second contribution is refused without a pull
            lrn.send(message(syncer, "a", 0, 0, 1.0, seed=seed))
            got += syncer.handle(next_incoming(server))
        assert [r.accepted for r in got] == [False, False] and snapshot(syncer) == old
        assert "TimeoutError" in got[0].reason and "until it says hello again" in got[1].reason
        assert len(transfers) == 1  # the second contribution was not pulled
        assert [r[0] for r in syncer.refused] == ["a", "a"]
        assert "the transfer from learner 'a' failed" in caplog.text
        monkeypatch.undo()
        # The learner restarted under its name says hello: its contributions are pulled (and merged) again.
        lrn.close()
        lrn = join(server, "a")
        lrn.send(message(syncer, "a", 0, 0, 1.0, seed=3))
        replies = syncer.handle(next_incoming(server))
        assert [r.accepted for r in replies] == [True] and syncer.versions() == [1]
    finally:
        released.set()
        lrn.close()
        server.close()


def test_a_merged_fragment_in_transfer_does_not_block_poll_and_a_blocking_poll_waits_for_it(monkeypatch):
    syncer = Syncer(init(), learners=["a"])
    server = MultiProcessTransport.for_syncer()
    server.attach(syncer)
    lrn = join(server, "a")
    real = multiprocess._transfer
    started, released = threading.Event(), threading.Event()

    class Held:
        """A transferred array whose values arrive when the test releases them."""

        def __init__(self, x):
            self.x = x

        def __array__(self, dtype=None, copy=None):
            started.set()
            released.wait(60)
            return np.asarray(self.x)

    monkeypatch.setattr(multiprocess, "_transfer", lambda *a: [Held(x) for x in real(*a)])
    values = syncer.fragment_values(0)
    try:
        server.reply(Reply("a", 0, 1, values))
        assert started.wait(30)  # the transport receives the arrays by itself, before any poll
        assert lrn.poll("a", timeout=0) is None  # and the thread that polls (trains) never waits for them
        threading.Timer(0.2, released.set).start()
        reply = lrn.poll("a", timeout=30)  # lock-step: wait until the arrays are local
        assert reply is not None and reply.fragment == 0 and reply.version == 1 and reply.accepted
        for a, b in zip(reply.values, values):
            np.testing.assert_array_equal(a, b)
    finally:
        released.set()
        lrn.close()
        server.close()


def test_the_syncer_binds_its_socket_before_its_transfer_server_takes_a_port(monkeypatch):
    """The transfer server picks a free port: started first, it could take the port the syncer was asked to bind
    ("Address already in use").  When it starts, the syncer's port already accepts connections; and a transfer
    server that cannot start leaves that port free again."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    real, seen = multiprocess.transfer_server, []

    def probe(host=None):
        with socket.socket() as c:
            seen.append(c.connect_ex(("127.0.0.1", port)))  # 0: something listens on the syncer's port
        return real(host)

    monkeypatch.setattr(multiprocess, "transfer_server", probe)
    t = MultiProcessTransport.for_syncer(f"tcp://127.0.0.1:{port}")
    t.close()
    assert seen == [0]

    def broken(host=None):
        raise ValueError("advertise: cannot bind")

    monkeypatch.setattr(multiprocess, "transfer_server", broken)
    with pytest.raises(ValueError, match="advertise") as failed:  # its traceback keeps the half-built transport
        MultiProcessTransport.for_syncer(f"tcp://127.0.0.1:{port}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the failed syncer closed its socket: the port is free
    del failed
