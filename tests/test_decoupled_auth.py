"""Who may contribute over the multi-process transport (in one process, fast): a header that claims another
learner's name is dropped, its offer released, and nothing of it merged."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")

from compjax.decoupled import MultiProcessTransport, Syncer, multiprocess
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


# --- ZeroMQ CURVE: the key is the identity -------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path):
    """Certificates of the syncer, of learners a and b (allowed) and of an intruder (not allowed)."""
    import shutil

    import zmq.auth

    made = tmp_path / "made"
    made.mkdir()
    (tmp_path / "allowed").mkdir()
    for name in ("syncer", "a", "b", "intruder"):
        public, secret = zmq.auth.create_certificates(made, name)
        if name in ("a", "b"):
            shutil.copy(public, tmp_path / "allowed")
    return {"dir": made, "allowed": tmp_path / "allowed", "secret": lambda n: made / f"{n}.key_secret",
            "public": lambda n: made / f"{n}.key"}


def secure_server(keys, syncer, **kwargs):
    server = MultiProcessTransport.for_syncer(key_file=keys["secret"]("syncer"), allowed_keys=keys["allowed"],
                                              **kwargs)
    server.attach(syncer)
    return server


def secure_join(server, keys, name, key=None, timeout=30.0):
    """Learner ``name`` (with the key of ``key``, default its own) joined over CURVE; None if no welcome came."""
    import threading

    lrn = MultiProcessTransport.for_learner(name, server.address, heartbeat_s=0.05,
                                            key_file=keys["secret"](key or name), server_key=keys["public"]("syncer"))
    box = {}

    def hello():
        try:
            box["start"] = lrn.join(timeout=timeout)
        except TimeoutError:
            pass

    t = threading.Thread(target=hello)
    t.start()
    drain(server, syncer=server._syncer, done=lambda: not t.is_alive(), timeout=timeout + 5)
    t.join()
    return lrn if "start" in box else (lrn.close() or None)


def test_over_curve_an_allowed_learner_joins_and_its_contribution_is_merged(keys):
    syncer = Syncer(init(), learners=["a"], min_quorum=1)
    server = secure_server(keys, syncer)
    a = secure_join(server, keys, "a")
    try:
        assert a is not None and server.secure
        a.send(message(syncer, "a", 0, 0, 1.0, seed=1))
        assert [h.learner for h in drain(server, syncer, lambda: syncer.merges)] == ["a"]
        reply = a.poll("a", timeout=30)  # the reply reaches a on the connection it said hello on
        assert reply is not None and reply.accepted and syncer.versions() == [1]
    finally:
        a.close()
        server.close()


def test_an_unauthenticated_hello_and_an_unknown_key_are_refused_and_nothing_registered(keys):
    import zmq

    syncer = Syncer(init(), learners=["a"], min_quorum=1)
    server = secure_server(keys, syncer)
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)  # no keys at all
    plain.setsockopt(zmq.ROUTING_ID, b"plain")
    stranger = ctx.socket(zmq.DEALER)  # CURVE, with a key not on the allow-list
    public, secret = zmq.auth.load_certificate(keys["secret"]("intruder"))
    stranger.curve_publickey, stranger.curve_secretkey = public, secret
    stranger.curve_serverkey = zmq.auth.load_certificate(keys["public"]("syncer"))[0]
    try:
        for sock in (plain, stranger):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.address)
            sock.send(b'{"type": "hello"}')
        # a, allowed, joins meanwhile: the server answered it, and neither of the others
        a = secure_join(server, keys, "a")
        assert a is not None
        drain(server, syncer, lambda: False, timeout=0.3)
        assert syncer.learners == ("a",) and not plain.poll(0) and not stranger.poll(0)
        a.close()
    finally:
        plain.close()
        stranger.close()
        ctx.term()
        server.close()


def test_over_curve_a_forged_name_and_a_take_over_are_refused_and_nothing_merged(keys, caplog):
    syncer = Syncer(init(), learners=["a", "b"], min_quorum=1)
    server = secure_server(keys, syncer, takeover_after_s=30.0)
    a, b = secure_join(server, keys, "a"), secure_join(server, keys, "b")
    try:
        old = snapshot(syncer)
        b.send(message(syncer, "a", 0, 0, 1.0, seed=1))  # b's key, a's name in the header
        assert drain(server, syncer, lambda: b.released) == [] and b.released == 1
        assert "claims to be learner 'a'" in caplog.text
        # A second connection with a's key while a's connection is alive: no welcome, a keeps its place.
        assert secure_join(server, keys, "a", timeout=0.5) is None
        assert "refused a second connection of learner 'a'" in caplog.text
        # b's key under the name a: b's key names it b, whatever it calls itself; as b it is already connected.
        assert secure_join(server, keys, "a", key="b", timeout=0.5) is None
        assert snapshot(syncer) == old and not syncer.merges and syncer.learners == ("a", "b")
        a.send(message(syncer, "a", 0, 0, 1.0, seed=2))  # a's own contribution, on its connection, is merged
        assert [h.learner for h in drain(server, syncer, lambda: syncer.merges)] == ["a"]
        reply = a.poll("a", timeout=30)
        assert reply is not None and reply.accepted
    finally:
        a.close()
        b.close()
        server.close()


def test_keys_are_checked_when_the_transport_is_built(keys, tmp_path):
    with pytest.raises(ValueError, match="key_file and allowed_keys"):
        MultiProcessTransport.for_syncer(key_file=keys["secret"]("syncer"))
    with pytest.raises(ValueError, match="secret key"):
        MultiProcessTransport.for_syncer(key_file=keys["public"]("syncer"), allowed_keys=keys["allowed"])
    with pytest.raises(ValueError, match="allowed_keys"):
        MultiProcessTransport.for_syncer(key_file=keys["secret"]("syncer"), allowed_keys=tmp_path / "none")
    with pytest.raises(ValueError, match="key_file and server_key"):
        MultiProcessTransport.for_learner("a", "tcp://127.0.0.1:5555", key_file=keys["secret"]("a"))
    with pytest.raises(ValueError, match="insecure=True"):
        MultiProcessTransport.for_syncer("tcp://0.0.0.0:0")


def test_the_syncer_pulls_only_from_the_address_a_learner_advertised_in_its_hello(caplog):
    """A header whose arrays it says sit at another address (any host the syncer can reach) is dropped: it never
    reaches the syncer, so nothing is pulled."""
    syncer = Syncer(init(), learners=["a"], min_quorum=1)
    server = MultiProcessTransport.for_syncer()
    server.attach(syncer)
    a = join(server, "a")
    try:
        advertised = a.transfer_address
        h = message(syncer, "a", 0, 0, 1.0, seed=1).header  # its frame, as send writes it, with another address
        a._say({"type": "header", "header": multiprocess._header_dict(h), "uuid": 7, "crc": 0,
               "address": "127.0.0.1:9"})
        assert drain(server, syncer, lambda: "pulls only from the address" in caplog.text) == []
        assert advertised in caplog.text and not syncer.refused and not syncer.merges and syncer.versions() == [0]
    finally:
        a.close()
        server.close()


@pytest.mark.slow  # two joins and a close: about 3 s
def test_a_learner_that_closes_says_goodbye_and_the_round_waiting_for_it_merges_at_once():
    syncer = Syncer(init(), learners=["a", "b"])  # quorum: both
    server = MultiProcessTransport.for_syncer()
    server.attach(syncer)
    a, b = join(server, "a"), join(server, "b")
    try:
        a.send(message(syncer, "a", 0, 0, 1.0, seed=1))
        drain(server, syncer, lambda: syncer.refused or syncer._rounds[0] is not None)
        assert syncer.versions() == [0]
        b.close()  # goodbye: b is gone, a's round is complete
        drain(server, syncer, lambda: syncer.merges)
        assert syncer.merges == [(0, 1, ("a",))] and syncer.live() == ("a",)
        reply = a.poll("a", timeout=30)
        assert reply is not None and reply.accepted
    finally:
        a.close()
        server.close()


def test_a_learner_that_gives_up_a_send_lets_its_arrays_go():
    server = MultiProcessTransport.for_syncer()
    server.attach(Syncer(init(), learners=["a"]))
    a = join(server, "a")
    try:
        a.send(message(server._syncer, "a", 0, 0, 1.0, seed=1))  # never received: the syncer is "down"
        a.send(message(server._syncer, "a", 0, 0, 1.0, seed=2))
        assert len(a._offers) == 2
        a.abandon("a", 0)  # both offers of fragment 0 are pulled back: the transfer server holds nothing of them
        assert a._offers == {}
    finally:
        a.close()
        server.close()
