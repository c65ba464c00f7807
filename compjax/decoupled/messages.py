"""What learners and the syncer say to each other: a contribution (header, then payload arrays) and a reply."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from compjax import accounting

#: How the reason of a restarted syncer's refusals starts (one per fragment, carrying its restored global
#: values and versions): a learner whose anchor is at that version keeps its parameters and sends again.
RESTARTED = "syncer restarted"


def message_bytes(comm_state: Any) -> int:
    """The bytes one contribution counts: the compressor's message size after it encoded the message.

    The one place where a decoupled learner's sends are counted, in the same unit as every
    compjax compressor (:func:`compjax.message_bytes`: the exact bytes of the compressed payload
    of the last ``update``; the learner's compressor has no worker axis, so no collective carries it
    and :func:`compjax.payload_bytes` reads 0 — the transport carries it instead).  These are
    exactly the bytes of the payload arrays a :class:`Contribution` carries (the message as the
    compressor encoded it: :mod:`compjax.decoupled.wire`); without a worker axis the non-finite
    vote counts 0 bytes.  A transport's own framing is not included.

    Args:
      comm_state: the state a compjax compressor returned from the ``update`` that encoded the
        message (one learner's, not worker-stacked).

    Returns:
      The byte count, a Python int >= 0.

    Raises:
      ValueError: ``comm_state`` holds no byte counter (not a compjax compressor's state).

    Examples:
      >>> import jax.numpy as jnp, compjax as cj
      >>> tx = cj.identity()
      >>> _, state = tx.update([jnp.ones(3)], tx.init([jnp.ones(3)]))
      >>> message_bytes(state)   # three float32
      12
    """
    return int(accounting.message_bytes(comm_state))


@dataclasses.dataclass(frozen=True)
class Header:
    """The part of a contribution the syncer checks before any of its arrays is received.

    Attributes:
      learner: the sending learner's name.
      fragment: the fragment index ``p`` (:func:`compjax.algorithms.fragment_assignment`).
      base_version: the fragment's version (number of merges the syncer had made of it) that the
        learner's anchor came from; the syncer's staleness of the contribution is its current
        version minus this.
      tokens: tokens the learner trained on since its last contribution of this fragment (the
        merge weight), a positive finite number.
      step: the learner's inner step after which the outer gradient was taken.
      shapes: shape of each payload array of the message (the compressor's encoded message, in
        the order its collectives take it, zero-size arrays left out: :mod:`compjax.decoupled.wire`).
      dtypes: NumPy dtype string of each array (``np.dtype(d).str``, e.g. ``'<u4'``).
      payload_bytes: the bytes the compressor counted for the message (:func:`message_bytes`);
        equal to the arrays' bytes.
      seq: the learner's sequence number of its contributions to this fragment, an integer >= 1,
        strictly increasing: one more than its previous one (the first is one more than the
        :class:`Start`'s ``seqs`` entry it began from).  The syncer refuses a contribution whose
        number is at or below the last it took from that learner for the fragment (a replay).
      shard: which shard of a sharded learner's parameters the arrays hold, in [0, shards)
        (:mod:`compjax.decoupled.sharded`); 0 for an unsharded learner.
      shards: how many shards the learner's parameters are split into, >= 1; 1 when unsharded.
    """

    learner: str
    fragment: int
    base_version: int
    tokens: float
    step: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    payload_bytes: int
    seq: int
    shard: int = 0
    shards: int = 1

    def array_bytes(self) -> int:
        """Bytes the declared arrays would take in memory (from ``shapes`` and ``dtypes`` alone).

        Raises:
          ValueError: a shape with a negative or non-integer dimension, or an unknown dtype.
        """
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
                raise ValueError(f"shape {shape!r} is not a tuple of non-negative integers")
            total += math.prod(shape) * np.dtype(dtype).itemsize
        return total


@dataclasses.dataclass(frozen=True)
class Contribution:
    """One learner's compressed outer gradient of one fragment: a header and the encoded message.

    Attributes:
      header: :class:`Header`.
      values: the compressor's payload arrays (e.g. packed codes and float32 scales; for the
        default :func:`compjax.identity`, one float32 buffer of the fragment's leaves, raveled and
        concatenated), as :func:`compjax.decoupled.wire.encoder` captures them; the syncer
        decodes them with the same compressor.
    """

    header: Header
    values: tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True)
class Reply:
    """The syncer's answer to a contribution: the fragment's global value after a merge, or a refusal.

    A merge comes back in one of two forms: ``values``, the whole global values (float32), or, when
    the syncer has a ``reply_compressor`` and the contributor's anchor is the version just before
    this merge (or, for a refusal of a stale contribution, just before the current version), ``update``:
    that compressor's encoded message of the outer update ``θ^g_p(version) − θ^g_p(version − 1)``, which the learner decodes and adds to its anchor (bit-identical to the
    syncer's global values: both apply the same decoded message, :func:`compjax.decoupled.wire.applier`).

    Attributes:
      learner: the learner it goes to.
      fragment: the fragment index.
      version: the fragment's version after the merge (or, for a refusal, its current version).
      values: the fragment's global parameters (one NumPy array per leaf), or None when the refusal
        carries none (a malformed contribution) or the merge travels as ``update``.
      accepted: whether the contribution took part in this merge.
      reason: why it was refused ('' when accepted).
      update: the payload arrays of the reply compressor's message of the outer update from
        ``version - 1`` to ``version`` (as :func:`compjax.decoupled.wire.encoder` captures them), or None.
      shard: the shard of a sharded learner's parameters the values are (:attr:`Header.shard`); 0 when unsharded.
    """

    learner: str
    fragment: int
    version: int
    values: tuple[np.ndarray, ...] | None
    accepted: bool = True
    reason: str = ""
    update: tuple[np.ndarray, ...] | None = None
    shard: int = 0

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays the reply carries: ``values``, else ``update``, else none."""
        return self.values if self.values is not None else (self.update or ())


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a learner starts: every fragment's global values and version, as the syncer holds them now.

    What :meth:`Syncer.register <compjax.decoupled.Syncer.register>` returns and what
    :class:`~compjax.decoupled.Learner` takes as ``start=`` (a learner that joins a running
    system starts from the current global model, not from the initial parameters).

    Attributes:
      values: per fragment, its global values (one NumPy array per leaf, float32 or wider).
      versions: per fragment, the number of merges made of it.
      seqs: per fragment, the last sequence number (:attr:`Header.seq`) the syncer took from the
        learner it was made for (0: none yet); empty when made for no learner (read as zeros).
        A learner that rejoins under its identity (a restart) numbers its next contributions
        from there, so none of them reads as a replay.
    """

    values: tuple[tuple[np.ndarray, ...], ...]
    versions: tuple[int, ...]
    seqs: tuple[int, ...] = ()
