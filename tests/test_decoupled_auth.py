"""Who may contribute over the multi-process transport (in one process, fast): a header that claims another
learner's name is dropped, its offer released, and nothing of it merged."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")

from compjax.decoupled import MultiProcessTransport, Syncer
from tests.test_decoupled_syncer import init, message, snapshot
from tests.test_decoupled_transport_faults import join


def drain(server, syncer, done, timeout=10.0):
    """Serve the syncer side until ``done()`` (or ``timeout`` seconds): every contribution received is handled;
    the headers received."""
    got = []
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        incoming = server.receive(timeout=0.05)
        if incoming is not None:
            got.append(incoming.header)
            for r in syncer.handle(incoming):
                server.reply(r)
    return got


def test_a_header_that_claims_another_learners_name_is_dropped_and_nothing_merged(caplog):
    syncer = Syncer(init(), learners=["a", "b"], min_quorum=1)
    server = MultiProcessTransport.for_syncer()
    server.attach(syncer)
    a, b = join(server, "a"), join(server, "b")
    try:
        old = snapshot(syncer)
        b.send(message(syncer, "a", 0, 0, 1.0, seed=1))  # b's connection, a's name
        assert drain(server, syncer, lambda: b.released) == []  # dropped: its offer given back, nothing received
        assert b.released == 1 and "claims to be learner 'a'" in caplog.text
        assert snapshot(syncer) == old and syncer.versions() == [0] and not syncer.merges
        a.send(message(syncer, "a", 0, 0, 1.0, seed=2))  # a's own contribution is merged
        assert [h.learner for h in drain(server, syncer, lambda: syncer.merges)] == ["a"]
        assert syncer.versions() == [1]
    finally:
        a.close()
        b.close()
        server.close()
