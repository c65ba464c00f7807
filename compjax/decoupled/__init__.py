"""Decoupled DiLoCo: independent learners that send fragments' compressed outer gradients to a syncer.

Every other compjax algorithm is one SPMD program whose workers wait for each other at every
synchronization.  Here each learner runs its own training step and never waits for the others:

* :class:`Learner` -- wraps one worker's ordinary training step; every ``sync_every`` inner steps
  per fragment (Streaming DiLoCo's schedule) it compresses the fragment's outer gradient with any
  compjax compressor (error feedback stays on the learner) and sends it from a background thread
  while it keeps training; the merged fragment is mixed in when it comes back.
* :class:`Syncer` -- holds the global parameters and the outer optimizer per fragment; merges a
  fragment once ``min_quorum`` learners sent it or its grace window ended, weighting each
  contribution by its tokens; bounds staleness; refuses malformed, stale or non-finite
  contributions without touching the model; checkpoints itself with orbax.
* :class:`Transport` -- what both sides need of the network; :class:`InProcessTransport` runs them
  as threads of one process; :class:`MultiProcessTransport` as separate processes (ZeroMQ control
  frames, arrays over ``jax.experimental.transfer``; needs ``pip install 'compjax[decoupled]'``).
* :class:`ShardedLearner`, :class:`ShardedSyncer` -- a learner that is itself a sharded program (e.g.
  an ``fsdp`` mesh of its own devices): its outer gradients leave shard by shard, never gathered on
  one device, and the syncer merges per shard on the host (:mod:`compjax.decoupled.sharded`).
* :func:`delayed_nesterov` -- the outer optimizer for asynchronous merges of part of the learners:
  Nesterov momentum that steps once per full round's share of tokens (Liu et al. 2024).
* :class:`Header`, :class:`Contribution`, :class:`Reply` -- the messages; :class:`Start` -- where a
  learner starts (:meth:`Syncer.register`: a late join); :func:`message_bytes` -- how a
  contribution's bytes are counted (the compressor's message size, :func:`compjax.message_bytes`).
  A contribution carries the compressor's encoded message, its payload arrays, whose bytes are
  the bytes counted; the syncer decodes it with the same compressor (:mod:`compjax.decoupled.wire`).

With ``min_quorum`` = all learners, no grace limit and learners that wait for each merge
(``wait_for_merge=True``), the system computes the global parameters of :func:`compjax.diloco`
(plain or with fragments) run as one SPMD program.
"""

from compjax.decoupled.learner import Learner, LearnerStats, default_worker_index
from compjax.decoupled.messages import Contribution, Header, Reply, Start, message_bytes
from compjax.decoupled.multiprocess import MultiProcessTransport, TransferError
from compjax.decoupled.outer import DelayedNesterovState, delayed_nesterov
from compjax.decoupled.sharded import ShardedLearner, ShardedSyncer, ShardLayout
from compjax.decoupled.syncer import Syncer
from compjax.decoupled.transport import Incoming, InProcessTransport, Transport

__all__ = ["Contribution", "DelayedNesterovState", "Header", "InProcessTransport", "Incoming", "Learner", "LearnerStats",
           "MultiProcessTransport", "Reply", "ShardLayout", "ShardedLearner", "ShardedSyncer",
           "Start", "Syncer", "TransferError", "Transport", "default_worker_index", "delayed_nesterov", "message_bytes"]
