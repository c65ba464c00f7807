"""A learner: an ordinary training step, with each fragment's compressed outer gradient sent in the background."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax._checks import check_range
from compjax.algorithms.diloco import fragment_assignment
from compjax.decoupled import wire
from compjax.decoupled.messages import Contribution, Header, RESTARTED, Reply, Start, message_bytes
from compjax.decoupled.transport import Transport
from compjax.workers import is_key

logger = logging.getLogger("compjax.decoupled")


def _fold_keys(state: Any, index: int) -> Any:
    """``state`` with every PRNG key field (a leaf named ``key``) replaced by ``fold_in(key, index)``."""

    def fold(path, x):
        last = path[-1] if path else None
        name = getattr(last, "name", getattr(last, "key", None))
        return jax.random.fold_in(x, index) if name == "key" and is_key(x) else x

    return jax.tree_util.tree_map_with_path(fold, state)


@jax.jit
def _delta(anchor, xs):
    """The outer gradient ``anchor - x`` leaf by leaf, in the anchor's dtype."""
    return [a - x.astype(a.dtype) for a, x in zip(anchor, xs)]


@jax.jit
def _mix(xs, new, a):
    """Streaming DiLoCo's merge ``a x + (1 - a) new`` leaf by leaf, in the parameters' dtypes."""
    return [(a * x.astype(g.dtype) + (1 - a) * g).astype(x.dtype) for x, g in zip(xs, new)]


def default_worker_index(name: str) -> int:
    """The worker index of a learner named ``name`` when none is given: CRC-32 of its UTF-8 bytes, in [0, 2**31)."""
    return zlib.crc32(str(name).encode()) & 0x7FFFFFFF


@dataclasses.dataclass
class LearnerStats:
    """What a learner measured.

    Attributes:
      bytes_sent: per fragment, the bytes of the payload arrays handed to the transport, summed (by
        the sender thread: complete once :meth:`Learner.finish` returned); equal to the bytes counted
        for the contributions (:func:`message_bytes`, checked when the learner is built).
      sends: per fragment, the contributions sent.
      delays: per fragment, for each reply, the inner steps taken between the send and the reply's use.
      refusals: ``(fragment, reason)`` of every refusal the syncer answered.
      step_seconds: wall seconds inside the training step (results awaited).
      wait_seconds: wall seconds spent blocked on the syncer's replies.
      abandoned: per fragment, the sends given up without a reply (``late_reply="drop"``).
      resent: per fragment, the sends lost with a syncer's restart and sent again.
    """

    bytes_sent: list[int]
    sends: list[int]
    delays: list[list[int]]
    refusals: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    step_seconds: float = 0.0
    wait_seconds: float = 0.0
    abandoned: list[int] = dataclasses.field(default_factory=list)
    resent: list[int] = dataclasses.field(default_factory=list)


class Learner:
    r"""One worker of asynchronous (decoupled) DiLoCo: inner steps, and each fragment's outer gradient sent.

    Wraps an ordinary training step of one worker, ``train_step(params, inner_state,
    batch) -> (params, inner_state, loss)`` (e.g. built with optax; called as given:
    jit it yourself).  Fragments are Streaming DiLoCo's
    (:func:`compjax.algorithms.fragment_assignment`): fragment ``p`` has the offset
    ``t_p = (p H) // fragments`` and is due after inner step ``s`` when
    ``s ≡ t_p (mod H)`` (``H = sync_every``, Douillard et al. 2025, Algorithm 2).
    When it is due, the learner takes the fragment's outer gradient
    ``Δ_p = θ^g_p − θ_p`` (its anchor, the global values it last received, minus
    its parameters, in float32), compresses it with ``compressor`` (any compjax
    compressor built with ``axis_name=None``; its state, e.g. the error-feedback
    residual, is this learner's, one per fragment), and hands the encoded message
    -- the compressor's payload arrays, e.g. packed codes and scales, captured with
    :func:`compjax.collectives.capture` -- with its byte count
    (:func:`message_bytes`) and the tokens trained on since the fragment's last
    send to a background thread that sends it (:class:`Transport`), while the
    next inner steps run.  The syncer decodes the payload with the same
    compressor (:mod:`compjax.decoupled.wire`) into exactly the values the
    learner's compressor decoded (and its error feedback subtracted).  When the
    compressor's non-finite guard skips an update (a non-finite outer gradient),
    the learner sends the compressor's message of zeros.

    When the syncer's reply comes back with the merged global values ``θ̃_p``, the
    anchor becomes ``θ̃_p`` and the parameters mix it in::

        θ_p ← α θ_p + (1 − α) θ̃_p        (Streaming DiLoCo's merge; α = alpha)

    and the delay (inner steps since the send) is recorded.  A reply that carries
    the syncer's compressed outer update instead of the values (the syncer's
    ``reply_compressor``; :attr:`Reply.update <compjax.decoupled.Reply.update>`) is
    decoded with this learner's ``reply_compressor`` and added to the anchor,
    ``θ̃_p = θ^g_p + D(message)``, with the syncer's own program
    (:func:`compjax.decoupled.wire.applier`): the anchor is then the syncer's global
    value bit for bit.  Such an update starts from the version just before its
    merge; should the anchor be at another version (it never is when the
    contribution was taken from the anchor's version and nothing else moved it),
    the reply is dropped with a warning and the anchor stays: the next
    contribution is stale and its refusal brings the whole values.  With
    ``wait_for_merge=True`` the learner instead blocks after each send until the
    reply arrives and takes ``θ_p ← θ̃_p`` (plain DiLoCo and Streaming DiLoCo
    without overlap: with every learner waiting and a full quorum, the system
    computes :func:`compjax.diloco`'s global parameters).  A fragment is never
    sent twice at once: when it is due again before its reply came, the learner
    waits for that reply first (``late_reply="wait"``), or (``"defer"``) goes on
    with its inner steps and sends the fragment right after the reply is mixed
    in, its outer gradient and its tokens then covering the extra steps (the
    learner never blocks on the syncer; the merge weights count the tokens), or
    (``"drop"``) defers likewise until the reply is ``reply_timeout_s`` late, then
    gives the send up (a ``WARNING``, :attr:`LearnerStats.abandoned`, the
    transport's :meth:`~compjax.decoupled.Transport.abandon` lets its arrays go)
    and sends the fragment anew: with the syncer down the learner trains on,
    holding at most one unanswered send per fragment, and :meth:`finish` gives up
    the last ones after ``reply_timeout_s`` instead of raising.  A refusal of a stale contribution carries the
    current global values and is mixed in the same way; other refusals are
    recorded in :attr:`stats` and logged.

    **Random compressors.**  A compressor that draws random numbers (random-k, QSGD,
    TernGrad) keeps a PRNG key in its state, the same for every learner built from
    it; its draws then differ by step but not by learner.  The learner folds its
    ``worker_index`` into every such key (each state field named ``key``:
    ``fold_in(key, worker_index)``) when it initializes the compressor, so that two
    learners with different indices draw different numbers, reproducibly.

    **Joining a running system.**  ``start`` (from :meth:`Syncer.register
    <compjax.decoupled.Syncer.register>`, or a transport's join) sets every
    fragment's parameters and anchor to the syncer's current global values and the
    versions to the syncer's, so the first contribution is from the current model
    (staleness 0); ``params`` then gives only the structure and the leaves that no
    fragment holds.

    Args:
      name: this learner's name (as the syncer knows it).
      train_step: ``(params, inner_state, batch) -> (params, inner_state, loss)``.
      params: the initial parameters, equal to the syncer's global ones (a pytree).
      inner_state: the initial state of the inner optimizer.
      transport: where contributions go and replies come from.
      sync_every: ``H``, inner steps between two sends of a fragment, an integer >= 1.
      fragments: the number of fragments, as the syncer's.
      compressor: a compjax compressor with ``axis_name=None`` for the outer
        gradients, or None for :func:`compjax.identity` (float32, exact); the
        syncer must be built with the same one.  It must send its whole message
        through the collectives that :func:`compjax.collectives.capture` records,
        and decode it from that message alone (every compjax compressor does).
      alpha: weight of the local parameters in the merge, in [0, 1] (unused with
        ``wait_for_merge``).
      wait_for_merge: block after each send until the merged fragment comes back.
      late_reply: when a fragment is due again before its previous reply came:
        ``"wait"`` (block for it), ``"defer"`` (train on; send once it came) or ``"drop"``
        (train on; give the send up once ``reply_timeout_s`` late and send anew; needs
        ``reply_timeout_s``).
      reply_timeout_s: the longest wait for one reply, > 0, or None (forever).
      worker_index: folded into the compressor's PRNG keys, an integer in [0, 2**31);
        default :func:`default_worker_index` of ``name`` (distinct names draw differently).
      start: a :class:`~compjax.decoupled.Start` to begin from (the fragments' global values
        and versions), or None to begin from ``params`` at version 0.
      reply_compressor: the syncer's ``reply_compressor`` (the same compressor), or None when the
        syncer sends whole values (a reply with an update is then dropped with a warning).
      max_tokens: the token cap this learner declared to the syncer (:meth:`Syncer.register
        <compjax.decoupled.Syncer.register>`'s ``max_tokens``), > 0, or None: a contribution's
        tokens are clipped to it (a contribution that covers more steps, e.g. a deferred one,
        weighs as much as the cap, never more: the syncer would refuse it).

    Attributes:
      params: the current parameters (the pytree ``train_step`` moves).
      inner_state: the inner optimizer's state.
      count: inner steps taken.
      stats: :class:`LearnerStats`.

    Raises:
      ValueError: an argument outside the ranges above, a ``start`` whose fragments,
        shapes or versions do not fit ``params`` and ``fragments``, or a compressor whose
        message cannot travel as its payload arrays (named, with the reason:
        :func:`compjax.decoupled.wire.check_capturable`).
      TimeoutError: (from :meth:`step` and :meth:`finish`) no reply within ``reply_timeout_s``.

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication", 2025
      (Algorithm 2: fragments, offsets, the α merge); Douillard et al.,
      "Decoupled DiLoCo", arXiv 2604.21428 (learners that send to a syncer
      without waiting for each other).

    Examples:
      >>> import numpy as np, optax, threading
      >>> from compjax.decoupled import InProcessTransport, Learner, Syncer
      >>> params = {"w": np.ones(2, np.float32)}
      >>> def train_step(p, s, target):   # one SGD step on |p - target|^2 / 2
      ...     return {"w": p["w"] - 0.1 * (p["w"] - target)}, s, 0.0
      >>> transport = InProcessTransport(["a"])
      >>> syncer, stop = Syncer(params, learners=["a"], outer=optax.sgd(1.0)), threading.Event()
      >>> server = threading.Thread(target=syncer.serve, args=(transport, stop)); server.start()
      >>> learner = Learner("a", train_step, params, (), transport, sync_every=2, wait_for_merge=True)
      >>> for _ in range(2):
      ...     _ = learner.step(np.zeros(2, np.float32))
      >>> learner.finish(); stop.set(); server.join()
      >>> syncer.global_params()["w"], learner.stats.bytes_sent
      (array([0.81, 0.81], dtype=float32), [8])
    """

    def __init__(
        self,
        name: str,
        train_step: Callable,
        params: Any,
        inner_state: Any,
        transport: Transport,
        *,
        sync_every: int,
        fragments: int = 1,
        compressor: optax.GradientTransformation | None = None,
        alpha: float = 0.5,
        wait_for_merge: bool = False,
        late_reply: str = "wait",
        reply_timeout_s: float | None = None,
        worker_index: int | None = None,
        start: Start | None = None,
        reply_compressor: optax.GradientTransformation | None = None,
        max_tokens: float | None = None,
    ):
        check_range("sync_every", sync_every, 1, None, integer=True, static=True)
        check_range("fragments", fragments, 1, None, integer=True, static=True)
        check_range("alpha", alpha, 0.0, 1.0)
        if late_reply not in ("wait", "defer", "drop"):
            raise ValueError(f"late_reply must be 'wait', 'defer' or 'drop', got {late_reply!r}")
        if late_reply == "drop" and reply_timeout_s is None:
            raise ValueError("late_reply='drop' needs reply_timeout_s (how late a reply is given up), got None")
        if reply_timeout_s is not None:
            check_range("reply_timeout_s", reply_timeout_s, 0.0, None, lo_open=True)
        if max_tokens is not None:
            check_range("max_tokens", max_tokens, 0.0, None, lo_open=True)
        index = default_worker_index(name) if worker_index is None else worker_index
        check_range("worker_index", index, 0, 2**31 - 1, integer=True, static=True)
        if compressor is not None and not isinstance(compressor, optax.GradientTransformation):
            raise ValueError(f"compressor must be a compjax compressor (axis_name=None) or None, got {compressor!r}")
        if reply_compressor is not None and not isinstance(reply_compressor, optax.GradientTransformation):
            raise ValueError("reply_compressor must be a compjax compressor (axis_name=None) or None, "
                             f"got {reply_compressor!r}")
        if not callable(train_step):
            raise ValueError(f"train_step must be a callable (params, inner_state, batch) -> ..., got {train_step!r}")  # noqa: TRY004
        self.name = str(name)
        self.params = params
        self.inner_state = inner_state
        self.count = 0
        self._step_fn = train_step
        self._transport = transport
        self._H = int(sync_every)
        self._alpha = float(alpha)
        self._wait = bool(wait_for_merge)
        self._defer = late_reply in ("defer", "drop")
        self._drop = late_reply == "drop"
        self._sent_at: dict[int, float] = {}  # fragment -> time.monotonic() of its unanswered send
        self._deferred: set[int] = set()  # fragments due while their previous reply was still out
        self._timeout = reply_timeout_s
        self._index = fragment_assignment(params, int(fragments))
        self._offsets = [(p * self._H) // len(self._index) for p in range(len(self._index))]
        leaves = jax.tree.leaves(params)
        wide = lambda x: jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)
        self._anchor = [[jnp.array(leaves[i], dtype=wide(leaves[i]), copy=True) for i in idx] for idx in self._index]
        self._delta, self._mix = _delta, _mix  # one compiled program per shape for every learner of the process
        self._tx = wire.default_compressor() if compressor is None else compressor
        self._encode = wire.encoder(self._tx)
        self.worker_index = int(index)
        self._comm = [_fold_keys(self._tx.init(a), self.worker_index) for a in self._anchor]
        checked = set()
        for a, comm in zip(self._anchor, self._comm):  # once per distinct fragment (it compiles the encoder)
            if wire.like_of(a) not in checked:
                wire.check_capturable(self._tx, comm, wire.like_of(a))
                checked.add(wire.like_of(a))
        self._reply_tx = reply_compressor
        self.max_tokens = None if max_tokens is None else float(max_tokens)
        if reply_compressor is not None:
            self._reply_apply = [wire.applier(reply_compressor, wire.like_of(a)) for a in self._anchor]
            self._reply_spec = [wire.payload_spec(reply_compressor, wire.like_of(a)) for a in self._anchor]
        self._version = [0] * len(self._index)
        self._seq = [0] * len(self._index)  # per fragment, the sequence number of the last contribution sent
        if start is not None:
            self._begin_at(start)
        self._tokens = [0.0] * len(self._index)
        self._sent_tokens = [0.0] * len(self._index)  # per fragment: the tokens its unanswered send covers
        self._outstanding: dict[int, int] = {}  # fragment -> inner step of its send
        self._sender = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"learner-{name}")
        self._sends: list[concurrent.futures.Future] = []
        P = len(self._index)
        self.stats = LearnerStats(bytes_sent=[0] * P, sends=[0] * P, delays=[[] for _ in range(P)],
                                  abandoned=[0] * P, resent=[0] * P)

    @property
    def fragments(self) -> int:
        """The number of fragments."""
        return len(self._index)

    def versions(self) -> list[int]:
        """Per fragment, the syncer's version this learner's anchor comes from."""
        return list(self._version)

    def warm_up(self, batch: Any) -> None:
        """Compile before joining: one ``train_step`` on the current state (its result discarded), and per fragment
        what a send and a reply run (the outer gradient, the encoder, the α mix, the reply codec's decoding).

        A learner that joins a running system should compile first and join after
        (:meth:`start_from`): its first contribution is then taken a few steps after the
        starting point, not a compile later, when the others may have merged more than
        ``max_staleness`` times.  ``train_step`` must not change its arguments in place (a pure
        JAX step does not).
        """
        jax.block_until_ready(self._step_fn(self.params, self.inner_state, batch))
        leaves = jax.tree.leaves(self.params)
        for p in range(self.fragments):  # what a send and a reply run: the outer gradient, encoding, mixing
            xs = [leaves[i] for i in self._index[p]]
            jax.block_until_ready(self._delta(self._anchor[p], xs))
            jax.block_until_ready(self._encode([jnp.zeros_like(a) for a in self._anchor[p]], self._comm[p]))
            jax.block_until_ready(self._mix(xs, self._anchor[p], self._alpha))
            if self._reply_tx is not None:
                zeros = tuple(np.zeros(x.shape, x.dtype) for x in self._reply_spec[p])
                jax.block_until_ready(self._reply_apply[p](self._anchor[p], zeros))

    def start_from(self, start: Start) -> None:
        """Set every fragment's parameters, anchor and version to ``start``'s (a late join; see ``start=``).

        Raises:
          ValueError: ``start`` does not fit (fragments, shapes, versions), or a send is in flight.
        """
        if self._outstanding:
            raise ValueError(f"start_from needs no send in flight; fragments {sorted(self._outstanding)} await replies")
        self._begin_at(start)

    def _begin_at(self, start: Start) -> None:
        if not isinstance(start, Start) or len(start.values) != self.fragments or len(start.versions) != self.fragments:
            raise ValueError(f"start must be a Start with {self.fragments} fragments' values and versions, got {start!r}")
        if start.seqs and (len(start.seqs) != self.fragments or not all(
                isinstance(q, (int, np.integer)) and not isinstance(q, bool) and q >= 0 for q in start.seqs)):
            raise ValueError(f"start: seqs must be empty or {self.fragments} integers >= 0, got {start.seqs!r}")
        leaves, treedef = jax.tree.flatten(self.params)
        for p, (values, version) in enumerate(zip(start.values, start.versions)):
            if len(values) != len(self._anchor[p]) or any(
                    np.shape(v) != a.shape for v, a in zip(values, self._anchor[p])):
                raise ValueError(f"start: fragment {p}'s values do not have the shapes of its leaves in params")
            if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
                raise ValueError(f"start: fragment {p}'s version must be an integer >= 0, got {version!r}")
            self._anchor[p] = [jnp.asarray(v, dtype=a.dtype) for v, a in zip(values, self._anchor[p])]
            self._version[p] = int(version)
            if start.seqs:  # a rejoin: number the next contributions after the last the syncer took
                self._seq[p] = max(self._seq[p], int(start.seqs[p]))
            for i, g in zip(self._index[p], self._anchor[p]):
                leaves[i] = jnp.asarray(g).astype(jnp.asarray(leaves[i]).dtype)
        self.params = jax.tree.unflatten(treedef, leaves)

    def anchor(self, fragment: int) -> tuple[np.ndarray, ...]:
        """The global values of ``fragment`` this learner holds (its anchor, at :meth:`versions`), NumPy copies."""
        return tuple(np.array(a, copy=True) for a in self._anchor[fragment])

    def compressor_state(self, fragment: int) -> Any:
        """The compressor's state of ``fragment``: this learner's own (e.g. its error-feedback residual)."""
        return self._comm[fragment]

    def due(self, step: int) -> list[int]:
        """The fragments whose outer gradient is sent after inner step ``step`` (>= 1)."""
        return [p for p, t in enumerate(self._offsets) if step >= 1 and (step - t) % self._H == 0]

    def step(self, batch: Any, tokens: float = 1.0) -> Any:
        """One inner step on ``batch`` (``tokens`` of it count toward the merge weights); then the due sends.

        Replies that came in are mixed in before the step.  Returns the step's loss.
        """
        self._apply_replies()
        start = time.perf_counter()
        self.params, self.inner_state, loss = self._step_fn(self.params, self.inner_state, batch)
        jax.block_until_ready(self.params)
        self.stats.step_seconds += time.perf_counter() - start
        self.count += 1
        self._tokens = [t + float(tokens) for t in self._tokens]
        due = self.due(self.count)
        for p in due:
            if p in self._outstanding and self._drop and time.monotonic() - self._sent_at[p] > self._timeout:
                self._give_up([p])  # the syncer is down or lost it: send anew below
            if p in self._outstanding and self._defer:  # sent once its reply is mixed in (_send_deferred)
                self._deferred.add(p)
                continue
            while p in self._outstanding:  # never two sends of one fragment at once
                self._await_reply()
            self._send(p)
        if self._wait:
            while self._outstanding:
                self._await_reply()
        return loss

    def finish(self) -> None:
        """Send the deferred fragments, wait for the sends in flight and their replies (mixed in), stop the sender."""
        self._send_deferred()
        while self._outstanding:
            try:
                self._await_reply()
            except TimeoutError:
                if not self._drop:
                    raise
                self._give_up(sorted(self._outstanding))
            self._send_deferred()
        for f in self._sends:
            f.result()
        self._sender.shutdown(wait=True)

    # --- sending ------------------------------------------------------------------------------------

    def _give_up(self, fragments: list[int]) -> None:
        """Stop waiting for the replies of ``fragments``' sends (``late_reply="drop"``): logged, counted, let go."""
        for p in fragments:
            if self._outstanding.pop(p, None) is None:
                continue
            self._deferred.discard(p)
            self.stats.abandoned[p] += 1
            logger.warning("learner %r: no reply for fragment %d within %s s: the send is given up, training goes on",
                           self.name, p, self._timeout)
            self._transport.abandon(self.name, p)

    def _check_sends(self) -> None:
        """Raise the error of a send that failed on the sender thread; forget the sends that are done."""
        pending = []
        for f in self._sends:
            if f.done():
                f.result()  # a failed send raises here, not later as a reply that never comes
            else:
                pending.append(f)
        self._sends = pending

    def _send(self, p: int) -> None:
        self._check_sends()
        leaves = jax.tree.leaves(self.params)
        delta = self._delta(self._anchor[p], [leaves[i] for i in self._index[p]])
        _, self._comm[p], payload, skipped = self._encode(delta, self._comm[p])  # dispatched: computed asynchronously
        self._seq[p] += 1
        tokens = self._tokens[p] if self.max_tokens is None else min(self._tokens[p], self.max_tokens)
        job = self._sender.submit(self._ship, p, self._version[p], tokens, self.count, payload, skipped,
                                  self._comm[p], self._seq[p])
        self._sent_tokens[p] = self._tokens[p]
        self._tokens[p] = 0.0
        self._deferred.discard(p)  # sent now: not again after its reply
        self._outstanding[p] = self.count
        self._sent_at[p] = time.monotonic()
        self.stats.sends[p] += 1
        self._sends.append(job)

    def _ship(self, p: int, base_version: int, tokens: float, step: int, payload: tuple, skipped: Any,
              comm_state: Any, seq: int) -> None:
        """On the sender thread: wait for the payload arrays, count their bytes, hand them to the transport."""
        if bool(skipped):  # the guard zeroed the output; the payload encodes the residual: send zeros' message
            logger.warning("learner %r: the outer gradient of fragment %d is not finite (the parameters or the "
                           "anchor hold NaN or inf): its contribution carries zeros", self.name, p)
            zeros = [jnp.zeros(a.shape, a.dtype) for a in self._anchor[p]]
            payload = self._encode(zeros, _fold_keys(self._tx.init(zeros), self.worker_index))[2]
        values = tuple(np.asarray(x) for x in payload)
        nbytes = message_bytes(comm_state)
        header = Header(self.name, p, base_version, tokens, step, tuple(v.shape for v in values),
                        tuple(v.dtype.str for v in values), nbytes, seq)
        self.stats.bytes_sent[p] += sum(int(v.nbytes) for v in values)  # written by this thread only
        self._transport.send(Contribution(header, values))

    # --- receiving ----------------------------------------------------------------------------------

    def _await_reply(self) -> None:
        start = time.perf_counter()
        while True:  # in slices, so that a send failing meanwhile raises its error rather than a time-out
            self._check_sends()
            left = None if self._timeout is None else self._timeout - (time.perf_counter() - start)
            reply = self._transport.poll(self.name, timeout=0.5 if left is None else max(0.0, min(0.5, left)))
            if reply is not None or (left is not None and left <= 0.5):
                break
        self.stats.wait_seconds += time.perf_counter() - start
        if reply is None:
            raise TimeoutError(f"learner {self.name!r}: no reply from the syncer within {self._timeout} s "
                               f"(fragments waiting: {sorted(self._outstanding)})")
        self._use(reply)

    def _apply_replies(self) -> None:
        while (reply := self._transport.poll(self.name, timeout=0.0)) is not None:
            self._use(reply)
        self._send_deferred()

    def _send_deferred(self) -> None:
        """Send each deferred fragment whose reply came (``late_reply="defer"``)."""
        for p in sorted(self._deferred - set(self._outstanding)):
            self._deferred.discard(p)
            self._send(p)

    def _update_problem(self, p: int, reply: Reply) -> str:
        """Why the compressed update of ``reply`` cannot be applied to fragment ``p``'s anchor ('' if it can)."""
        if self._reply_tx is None:
            return "this learner has no reply_compressor (build it with the syncer's)"
        if reply.version != self._version[p] + 1:
            return f"it starts from version {reply.version - 1}, the anchor is at version {self._version[p]}"
        got = tuple((np.shape(x), np.asarray(x).dtype) for x in reply.update)
        want = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in self._reply_spec[p])
        if got != want:
            return f"its arrays {got} are not the reply compressor's message {want}"
        return ""

    def _use(self, reply: Reply) -> None:
        p = reply.fragment
        sent_at = self._outstanding.pop(p, None)
        if not reply.accepted:
            self.stats.refusals.append((p, reply.reason))
            logger.warning("learner %r: the syncer refused fragment %r: %s", self.name, p, reply.reason)
        if not 0 <= p < self.fragments or (reply.values is None and reply.update is None):
            return
        if reply.values is not None:
            new = [jnp.asarray(v) for v in reply.values]
        else:
            why = self._update_problem(p, reply)
            if why:
                logger.warning("learner %r: dropped the merged update of fragment %d (version %d): %s",
                               self.name, p, reply.version, why)
                return
            new = list(self._reply_apply[p](self._anchor[p], tuple(reply.update)))
        if (not reply.accepted and reply.reason.startswith(RESTARTED) and reply.values is not None
                and int(reply.version) == self._version[p]):
            # A restarted syncer at this anchor's version: the anchor is its global model, so the inner steps
            # since then are still an outer gradient from it.  Keep the parameters (no mix) and, if a send was
            # lost with the restart, send the fragment again, its tokens included (as a deferred send).
            self._anchor[p] = [jnp.asarray(v, dtype=a.dtype) for v, a in zip(new, self._anchor[p])]
            if sent_at is not None:
                self._tokens[p] += self._sent_tokens[p]
                self._sent_tokens[p] = 0.0
                self._deferred.add(p)
                self.stats.resent[p] += 1
                logger.warning("learner %r: fragment %d's send was lost with the syncer's restart; sending it again",
                               self.name, p)
            return
        if sent_at is not None:
            self.stats.delays[p].append(self.count - sent_at)
        self._anchor[p] = new
        self._version[p] = int(reply.version)
        leaves, treedef = jax.tree.flatten(self.params)
        xs = [jnp.asarray(leaves[i]) for i in self._index[p]]
        a = 0.0 if self._wait else self._alpha
        merged = [g.astype(x.dtype) for x, g in zip(xs, new)] if a == 0.0 else self._mix(xs, new, a)
        for i, m in zip(self._index[p], merged):
            leaves[i] = m
        self.params = jax.tree.unflatten(treedef, leaves)
