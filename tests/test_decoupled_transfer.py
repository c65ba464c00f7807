"""The arrays of the multi-process transport arrive as they were sent, or not at all (in one process, fast).

jaxlib 0.10.2's transfer, pulling several arrays at once on a loaded machine, has delivered the first bytes of
one array into another of the same pull (the benchmark's lock-step runs then differed from run to run). Each
offer is now one buffer (the arrays' bytes one after the other) and its CRC-32 rides in the frame: a receive
whose bytes differ raises ``TransferError`` and is never used.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("zmq")

from compjax.decoupled import MultiProcessTransport, Syncer, multiprocess
from tests.test_decoupled_auth import drain
from tests.test_decoupled_syncer import init, message, snapshot
from tests.test_decoupled_transport_faults import join

ARRAYS = (
    np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5,
    np.array([1.5, -2.25, np.nan], dtype=ml_dtypes.bfloat16),
    np.arange(7, dtype=np.uint8),
    np.float32(3.0).reshape(()),
    np.zeros((0, 3), np.float32),
    np.array([2**40 + 1, -3], dtype=np.int64),
)


def flipped_crc(offer):
    """``offer`` whose CRC-32 for the frame is off by one bit: what the receiver sees when bytes change."""
    def bad(arrays, server=None):
        uuid, crc = offer(arrays, server)
        return uuid, crc ^ 1
    return bad


def test_packed_arrays_come_back_bit_for_bit():
    """Mixed dtypes (bfloat16 NaN included), a scalar and an empty array: the bytes, shapes and dtypes survive."""
    buf = multiprocess._pack(ARRAYS)
    assert buf.dtype == np.uint8 and buf.size == sum(a.nbytes for a in ARRAYS)
    shapes, dtypes = [a.shape for a in ARRAYS], [a.dtype.str for a in ARRAYS]
    assert multiprocess._packed_bytes(shapes, dtypes) == buf.size
    out = multiprocess._unpack(buf, shapes, dtypes)
    for a, b in zip(ARRAYS, out):
        assert b.shape == a.shape and b.dtype.itemsize == a.dtype.itemsize
        assert b.tobytes() == np.ascontiguousarray(a).tobytes()


def test_an_offer_is_one_buffer_and_a_pull_checks_its_crc():
    """One array per offer (nothing in a pull to mix up); the pull gives the arrays back exactly with the
    sender's CRC-32, and raises TransferError with any other (the arrays are not returned)."""
    server = multiprocess.transfer_server("127.0.0.1")
    offered = []
    real = server.await_pull

    class Spy:
        def await_pull(self, uuid, arrays):
            offered.append(list(arrays))
            real(uuid, arrays)

    shapes, dtypes = [a.shape for a in ARRAYS], [a.dtype.str for a in ARRAYS]
    uuid, crc = multiprocess._offer(ARRAYS, Spy())
    assert len(offered) == 1 and len(offered[0]) == 1 and offered[0][0].dtype == np.uint8
    out = multiprocess._pull(server.address(), uuid, shapes, dtypes, 30.0, "test", crc)
    assert [b.tobytes() for b in out] == [np.ascontiguousarray(a).tobytes() for a in ARRAYS]
    uuid, crc = multiprocess._offer(ARRAYS, server)
    with pytest.raises(multiprocess.TransferError, match="CRC-32"):
        multiprocess._pull(server.address(), uuid, shapes, dtypes, 30.0, "test", crc ^ 1)


def test_a_contribution_whose_bytes_change_on_the_way_is_refused_and_nothing_merged(monkeypatch, caplog):
    """The learner's header carries the CRC-32 of what it offered; bytes that arrive otherwise (here: the CRC
    in the frame off by one bit) are refused: the model stays as it was. The learner is still pulled from: its
    next send merges."""
    syncer = Syncer(init(), learners=["a"], min_quorum=1)
    server = MultiProcessTransport.for_syncer()
    server.attach(syncer)
    a = join(server, "a")
    offer = multiprocess._offer
    try:
        old = snapshot(syncer)
        monkeypatch.setattr(multiprocess, "_offer", flipped_crc(offer))
        a.send(message(syncer, "a", 0, 0, 1.0, seed=1))
        drain(server, syncer, lambda: syncer.refused)
        assert "arrived corrupted" in caplog.text and len(syncer.refused) == 1
        assert snapshot(syncer) == old and syncer.versions() == [0] and not syncer.merges
        monkeypatch.setattr(multiprocess, "_offer", offer)
        a.send(message(syncer, "a", 0, 0, 1.0, seed=2))
        drain(server, syncer, lambda: syncer.merges)
        assert syncer.versions() == [1] and len(syncer.refused) == 1
    finally:
        a.close()
        server.close()


def corrupting_offers(monkeypatch, times):
    """The next ``times`` offers of this process announce a CRC-32 off by one bit (their bytes 'change on the
    way'); the later ones are sound."""
    offer, left = multiprocess._offer, [times]

    def maybe_bad(arrays, server=None):
        uuid, crc = offer(arrays, server)
        if left[0] > 0:
            left[0] -= 1
            crc ^= 1
        return uuid, crc

    monkeypatch.setattr(multiprocess, "_offer", maybe_bad)
    return left


def merged_reply(monkeypatch, caplog, corrupt):
    """Learner a's one contribution merged; the syncer's reply offered with ``corrupt`` bad CRCs first: the
    syncer, what reached the learner, and the resend counts the learner still keeps (none once the reply
    arrived or was given up)."""
    syncer = Syncer(init(), learners=["a"], min_quorum=1)
    server = MultiProcessTransport.for_syncer()
    server.attach(syncer)
    a = join(server, "a")
    try:
        a.send(message(syncer, "a", 0, 0, 1.0, seed=1))
        left = corrupting_offers(monkeypatch, corrupt)  # from here on: the syncer's reply and its resends
        got = []

        def done():
            reply = a.poll("a", timeout=0.0)
            if reply is not None:
                got.append(reply)
            return bool(got) or (left[0] == 0 and "dropped a reply" in caplog.text)

        drain(server, syncer, done, timeout=20.0)
        if not got:  # the last ask's reply (if any) may still be on its way
            drain(server, syncer, lambda: bool(got.append(a.poll("a", timeout=0.2)) or got[-1] is not None),
                  timeout=2.0)
        return syncer, [r for r in got if r is not None], dict(a._resends)
    finally:
        a.close()
        server.close()


def test_a_reply_whose_bytes_change_on_the_way_is_asked_for_again(monkeypatch, caplog):
    """A merged fragment that arrives corrupted never reaches the learner's model: the learner asks the syncer for
    it again (a resend frame) and receives the syncer's values exactly."""
    syncer, got, resends = merged_reply(monkeypatch, caplog, corrupt=1)
    assert syncer.versions() == [1] and resends == {}
    assert "asked the syncer to send it again" in caplog.text and "offered again" in caplog.text
    assert len(got) == 1 and got[0].version == 1 and got[0].accepted
    want = syncer.state()["global"][0]  # fragment 0's global leaves after the merge
    assert [np.asarray(x).tobytes() for x in got[0].values] == [np.asarray(x).tobytes() for x in want]


def test_a_reply_corrupted_every_time_is_dropped_loudly_after_three_asks(monkeypatch, caplog):
    """Bytes that keep arriving changed: after RESENDS asks the reply is dropped with a warning that names the
    corruption, and nothing reaches the learner."""
    syncer, got, resends = merged_reply(monkeypatch, caplog, corrupt=1 + multiprocess.RESENDS)
    assert syncer.versions() == [1] and got == [] and resends == {}
    assert caplog.text.count("asked the syncer to send it again") == multiprocess.RESENDS
    assert "dropped a reply" in caplog.text and "arrived corrupted" in caplog.text
