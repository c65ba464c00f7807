"""The syncer: global parameters and outer optimizer state per fragment, merged from learners' contributions."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax._checks import check_range
from compjax.algorithms.diloco import fragment_assignment
from compjax.decoupled import wire
from compjax.decoupled.messages import Contribution, Header, Reply, Start, message_bytes
from compjax.decoupled.transport import Incoming, Transport

logger = logging.getLogger("compjax.decoupled")


@dataclasses.dataclass
class _Round:
    """The contributions of one fragment waiting for their merge."""

    opened: float
    entries: dict = dataclasses.field(default_factory=dict)  # learner -> (weight, values, staleness, norm, tokens)
    arrived: list = dataclasses.field(default_factory=list)  # the arrival time of each accepted contribution


def _accumulate(acc, decoded, w):
    """``acc + w * decoded`` leaf by leaf, in float32: one term of the token-weighted mean."""
    return [a + w * d.astype(jnp.float32) for a, d in zip(acc, decoded)]


#: How many of a fragment's last merged rounds the adaptive grace window reads.
_SPREAD_HISTORY = 16
_ACCUMULATE = jax.jit(_accumulate)  # shared by every syncer of the process: one compile per shape
_SUB = jax.jit(lambda new, old: [n - o for n, o in zip(new, old)])


def _norm(values) -> float:
    """The L2 norm of a fragment's decoded outer gradient, summed in float64 on the host (no overflow)."""
    return math.sqrt(math.fsum(float(np.sum(np.square(np.asarray(v, np.float64)))) for v in values))


def _all_finite(tree) -> bool:
    """Whether every floating-point entry of ``tree``'s leaves is finite (NumPy on the host: nothing compiles)."""
    for x in jax.tree.leaves(tree):
        x = np.asarray(x)
        if x.dtype.kind in "fc" or jnp.issubdtype(x.dtype, jnp.floating):
            if not np.all(np.isfinite(x.astype(np.float64))):
                return False
    return True


def _outer_step(outer_tx, anchor, outer_state, mean, share):
    """One outer step from the mean outer gradient (DiLoCo's: ``θ ← θ + OuterOpt(Δ̄)``); ``share``, the merge's share
    of a full round, is passed as an extra argument (:func:`compjax.decoupled.delayed_nesterov` reads it)."""
    mean = [m.astype(a.dtype) for m, a in zip(mean, anchor)]
    step, outer_state = outer_tx.update(mean, outer_state, anchor, share=share)
    return optax.apply_updates(list(anchor), step), outer_state


class Syncer:
    r"""Holds the global model and the outer optimizer; merges fragments that independent learners send.

    The parameters are split into ``fragments`` as Streaming DiLoCo's
    (:func:`compjax.algorithms.fragment_assignment`; only floating-point, non-empty
    leaves take part).  Per fragment ``p`` the syncer keeps the global values
    ``θ^g_p`` (float32, or the leaf's dtype if wider), the state of the outer
    optimizer over them, and a version ``v_p`` (the number of merges so far).

    A learner's contribution to fragment ``p`` is its compressed outer gradient,
    the compressor's encoded message (its payload arrays, e.g. packed codes and
    scales: :mod:`compjax.decoupled.wire`), taken from version ``v``, with the
    tokens ``n_i`` it trained on since its previous contribution to ``p``.  The
    syncer decodes it with ``compressor`` (the learners' compressor) into
    ``m_i ≈ θ^g_p(v) − θ_p``, exactly the values the learner's compressor
    decoded.  Its staleness
    is ``τ_i = v_p − v``.  **Staleness rule** (bounded staleness, as the stale
    synchronous parallel parameter server of Ho et al., NeurIPS 2013, with the
    exponential discount ``e^{−α τ}`` of CGAD, arXiv 2605.09126, taking its
    ``γ(τ) = 1``): a contribution with ``τ_i > max_staleness`` is refused; the
    others weigh ``w_i = n_i · e^{−staleness_decay · τ_i}`` (``staleness_decay =
    0``: tokens alone) and the sum is divided by the undiscounted tokens ``Σ n_i``,
    so a stale contribution's discount shrinks the outer update itself (CGAD's
    staleness-scaled update), also when it is alone in its round (a mean over
    ``Σ w_i`` would cancel the discount of a round's only contribution).  Contributions wait in the fragment's round; the round
    opens with its first accepted contribution and is **merged** as soon as
    ``min_quorum`` learners have contributed, or when ``grace_s`` seconds have
    passed since it opened::

        Δ̄_p   = Σ_i w_i m_i / Σ_i n_i                (token-weighted mean, float32)
        θ^g_p ← θ^g_p + OuterOpt(Δ̄_p)                (default Nesterov SGD, lr 0.7, momentum 0.9)
        v_p   ← v_p + 1

    and every contributor gets the new ``θ^g_p`` back (:class:`Reply`).

    **Compressed replies** (``reply_compressor``, e.g. ``cj.cast(jnp.bfloat16)`` or
    ``cj.e3m0()``, ``axis_name=None``): the merge's outer update ``u_p = θ^g_p(new)
    − θ^g_p`` is encoded with that compressor (its state, e.g. an error-feedback
    residual, is the syncer's, one per fragment) and the syncer applies to its own
    global values exactly the decoded message it sends, ``θ^g_p ← θ^g_p +
    D(E(u_p))`` (:func:`compjax.decoupled.wire.applier`: one compiled program on
    both sides), so a learner that adds the same message to its anchor holds the
    syncer's global values bit for bit.  A contributor whose anchor is the version
    just before the merge (staleness 0) gets the message (:attr:`Reply.update`),
    and so does the refusal of a contribution one merge behind (staleness 1 >
    ``max_staleness``): the last merge's message brings its anchor to the current
    values.  Any other reply (a staler contribution merged or refused, a join, the
    first refusal after a restart) carries the whole float32 values.  The outer optimizer state follows the exact mean ``Δ̄_p``.
    Without ``reply_compressor`` (the default) every reply carries the whole
    float32 values, and the system computes :func:`compjax.diloco`'s global
    parameters as said below; with it, the global model differs from those by what
    the reply codec rounds (an error-feedback codec carries that into the next merge).  The sum
    runs over the contributions sorted by learner name, not in their order of
    arrival, so the merged values do not depend on which came first (bit for
    bit: two runs with the same rounds give the same global model).  With
    ``min_quorum`` = all learners, equal tokens and no staleness this is exactly
    the outer step of :func:`compjax.diloco` (DiLoCo, Douillard et al. 2023;
    Streaming DiLoCo, Douillard et al. 2025, with fragments): the mean over
    workers, then the outer optimizer.

    **Adaptive grace window** (``adaptive_grace = c``).  Decoupled DiLoCo (arXiv
    2604.21428) names an adaptive grace window but its rule is not reproduced here; this is a
    documented rule of compjax's own, driven by the recent spread of arrival times.  For each merged
    round of fragment ``p`` with two or more contributions the syncer records its *spread*, the time
    from the round's opening (its first contribution) to its last contribution; a new round of ``p``
    waits for its quorum at most::

        grace_p = min(grace_s, c · q90(spreads of p's last 16 such rounds))

    (``grace_s`` until there is one): long enough for the arrivals as spread as the recent ones (the
    90th percentile, times the margin ``c``), never longer than ``grace_s``; a straggler slower than
    that misses the round instead of holding every learner's reply.  :meth:`grace` reads the current
    window.

    **Partial rounds** (``partial_rounds``).  With ``"mean"`` (the default) a round
    merged by part of the learners moves the global values as far as a full round
    (the divisor is its own ``Σ n_i``).  When rounds are small and frequent
    (asynchronous learners out of phase, a quorum below the membership) that applies
    the outer step, momentum included, once per partial round, several times per
    period: the model moves several full steps per period and overshoots.  With
    ``"share"`` the divisor is the tokens the learners not lost declared per
    contribution (:meth:`register`'s ``max_tokens``; a learner without a cap counts
    the round's mean ``n_i``), at least ``Σ n_i``::

        Δ̄_p = Σ_i w_i m_i / max(Σ_i n_i, Σ_{l not lost} cap_l)

    A learner that left cleanly (:meth:`leave`) still counts: at the end of a finite
    run the last learner's remaining contributions, merged alone once the others
    have left, move the model by its share, not by a full step each (in a trial run
    four such full steps at the end put the loss 18% above lock-step's).  A lost
    learner does not count: the others' rounds move the model as far as before.
    So a round holding a share of the learners' tokens moves the model by that
    share, as an asynchronous Local-SGD server applies each of ``N`` workers' outer
    gradients at ``1/N`` (Liu et al., "Asynchronous Local-SGD Training for Language
    Modeling", arXiv 2401.09135).  Only the outer gradient is scaled: a momentum
    optimizer such as the default one still steps its momentum at every merge; pass
    ``outer=``:func:`~compjax.decoupled.delayed_nesterov` to step it once per full
    round's share of tokens (their Delayed Nesterov; each merge's share,
    ``min(1, Σ n_i / Σ cap_l)``, reaches the outer optimizer as the extra argument
    ``share``).  A full round of equal tokens is the mean either way, so the rule
    changes nothing at full quorum.

    **Bounded influence.**  No single contribution can set or overflow a merge:

    * *tokens*: each learner has a cap on the tokens of one contribution, the one it
      declared when it registered (:meth:`register`'s ``max_tokens``: its inner steps
      between two contributions of a fragment times its batch tokens), else
      ``max_tokens``; a declaration above ``max_tokens`` is refused, and so is a
      contribution whose tokens exceed its learner's cap.
    * *norm*: a contribution whose decoded outer gradient has an L2 norm (float64)
      above ``norm_bound`` times the median of the fragment's last ``norm_window``
      merged non-zero norms is refused (the median: a robust reference that a few
      large contributions cannot raise; before the fragment's first merge there is no
      reference and only the finite checks apply).
    * *the merge*: the merged global values and the new outer optimizer state are
      checked finite before they replace the fragment's; if any entry is not, the
      round is refused: a ``WARNING``, each contributor's refusal (carrying the
      current values) in :attr:`refused`, and the model, outer state and version as
      they were.

    **Refusals.**  A contribution from an unknown learner, for a fragment out of
    range, whose payload arrays do not have the shapes and dtypes of the
    compressor's message for the fragment (or whose declared size is larger),
    with tokens not positive and finite or above its learner's cap, from a version
    the fragment never had, at or below its learner's last sequence number for
    the fragment (a replay), staler than ``max_staleness``, a second one from the
    same learner in one round, whose decoded value holds a non-finite entry, or
    whose norm exceeds the norm bound, is refused: a
    ``WARNING`` on the
    ``compjax.decoupled`` logger names the learner, the fragment and the reason,
    :attr:`refused` records it, and neither the global model nor the outer state
    change.  The header is checked before the arrays are pulled from the
    transport, so nothing larger than the fragment is ever allocated.

    **Membership.**  :meth:`register` adds a learner while the syncer runs (a late
    join) and returns its starting point, the current global values and versions
    (:class:`Start`).  With ``heartbeat_timeout_s`` set, the syncer keeps the time
    of each learner's last message (a contribution, or :meth:`heartbeat`, which a
    transport calls for every message it receives).  A learner silent for longer
    is **lost** (one never heard from is not: it may be starting up): a
    ``WARNING`` names it with the wall-clock time of its last message,
    :attr:`lost` records it, and rounds stop waiting for it: a round merges once
    ``min_quorum`` learners, or every learner not lost if fewer are left, have
    contributed; until a loss is noticed, the grace window bounds the wait.  A
    lost learner that speaks again is counted again.  A learner that leaves
    cleanly (:meth:`leave`, its goodbye) is out of the live membership at once;
    with ``quorum_fraction`` the quorum is that fraction of the live learners.

    Args:
      params: the initial global parameters (a pytree; every learner starts from them).
      learners: the names of the learners allowed to contribute (distinct strings).
      fragments: the number of fragments, in [1, floating-point leaves of ``params``].
      compressor: the learners' compressor (``axis_name=None``), which decodes their
        payloads, or None for :func:`compjax.identity` (the learners' default: float32).
      outer: the outer optimizer (an optax transformation); default
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` (DiLoCo's).  Its ``update`` is given the merge's share
        of a full round as the extra argument ``share`` (1.0 with ``partial_rounds="mean"``); transforms that take
        no extra arguments ignore it.  With ``partial_rounds="share"``,
        :func:`~compjax.decoupled.delayed_nesterov` steps the momentum once per full round's share (Delayed
        Nesterov, Liu et al. 2024) instead of at every partial merge.
      min_quorum: contributions that trigger a merge, in [1, len(learners)];
        default all learners.
      quorum_fraction: in (0, 1], or None (default): the quorum follows the live membership,
        ``ceil(quorum_fraction x live learners)`` (joins raise it, losses and leaves lower it);
        not with ``min_quorum``.
      grace_s: seconds a round waits for its quorum after it opened, > 0;
        None (default) waits forever.
      max_staleness: the largest staleness accepted, an integer >= 0.
      staleness_decay: ``α >= 0`` of the weight ``e^{−α τ}`` of a stale contribution.
      heartbeat_timeout_s: seconds of silence after which a learner is lost, > 0; None
        (default) never declares one lost.
      reply_compressor: a compjax compressor (``axis_name=None``) for the merged updates sent
        back, or None (default) for whole float32 values; the learners must be built with the same
        one (:class:`~compjax.decoupled.Learner`'s ``reply_compressor``).
      max_tokens: the largest tokens of one contribution, > 0: the cap of the learners listed in
        ``learners`` and the bound on what a registering learner may declare; None (default): no
        bound beyond the learners' own declarations.
      norm_bound: the multiple ``c >= 1`` of the median of recent merged norms above which a
        contribution is refused (default 10); None turns the norm bound off.
      norm_window: how many of a fragment's last merged contribution norms the median is taken
        over, an integer >= 1 (default 16).
      adaptive_grace: ``c >= 1``, or None (default: the grace window is ``grace_s``): the grace window
        follows the recent spread of arrivals (see *Adaptive grace window*); needs ``grace_s``, its upper bound.
      partial_rounds: ``"mean"`` (default) or ``"share"`` (see *Partial rounds*): how far a round merged with
        part of the learners (those not lost) moves the global values.

    Attributes:
      learners: the names of the known learners (a tuple; :meth:`register` appends).
      refused: ``(learner, fragment, reason)`` of every refused contribution, in order.
      merges: ``(fragment, version, learners)`` of every merge, in order.
      lost: ``(learner, last_seen)`` of every learner declared lost, in order; ``last_seen``
        is the wall-clock time of its last message (``time.time()`` seconds).
      reply_bytes: per fragment, the bytes of the replies sent as compressed updates, summed over
        their recipients (each the reply compressor's message size, :func:`message_bytes`).

    Raises:
      ValueError: any argument outside the ranges above, ``outer`` not an optax
        transformation, or a ``compressor`` whose message cannot be captured as arrays.

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of
      Language Models", 2023; Douillard et al., "Streaming DiLoCo with
      overlapping communication", 2025; Douillard et al., "Decoupled DiLoCo",
      arXiv 2604.21428 (learners, a syncer, quorum, grace window, token
      weights); Ho et al., "More Effective Distributed ML via a Stale
      Synchronous Parallel Parameter Server", NeurIPS 2013; CGAD, arXiv
      2605.09126.

    Examples:
      >>> import numpy as np, optax
      >>> from compjax.decoupled import Syncer, Contribution, Header
      >>> s = Syncer({"w": np.ones(2, np.float32)}, learners=["a", "b"], outer=optax.sgd(1.0))
      >>> def send(name, delta, tokens):
      ...     h = Header(name, 0, 0, tokens, 1, ((2,),), ("<f4",), 8, seq=1)
      ...     return s.submit(Contribution(h, (np.full(2, delta, np.float32),)))
      >>> send("a", 0.5, 1), send("b", 0.2, 3)   # the second completes the quorum: merged
      ([], [Reply(learner='a', ...), Reply(learner='b', ...)])
      >>> s.global_params()["w"]   # 1 - (0.5 * 1 + 0.2 * 3) / 4
      array([0.725, 0.725], dtype=float32)
    """

    def __init__(
        self,
        params: Any,
        *,
        learners: Sequence[str],
        fragments: int = 1,
        compressor: optax.GradientTransformation | None = None,
        outer: optax.GradientTransformation | None = None,
        min_quorum: int | None = None,
        quorum_fraction: float | None = None,
        grace_s: float | None = None,
        max_staleness: int = 0,
        staleness_decay: float = 0.0,
        heartbeat_timeout_s: float | None = None,
        reply_compressor: optax.GradientTransformation | None = None,
        max_tokens: float | None = None,
        norm_bound: float | None = 10.0,
        norm_window: int = 16,
        adaptive_grace: float | None = None,
        partial_rounds: str = "mean",
    ):
        names = [str(x) for x in learners]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"learners must be a non-empty sequence of distinct names, got {learners!r}")
        check_range("fragments", fragments, 1, None, integer=True, static=True)
        quorum = len(names) if min_quorum is None else min_quorum
        check_range("min_quorum", quorum, 1, len(names), integer=True, static=True)
        if quorum_fraction is not None:
            check_range("quorum_fraction", quorum_fraction, 0.0, 1.0, lo_open=True)
            if min_quorum is not None:
                raise ValueError(f"quorum_fraction and min_quorum exclude each other, got {quorum_fraction!r} and "
                                 f"{min_quorum!r}")
        self.quorum_fraction = None if quorum_fraction is None else float(quorum_fraction)
        if grace_s is not None:
            check_range("grace_s", grace_s, 0.0, None, lo_open=True)
        check_range("max_staleness", max_staleness, 0, None, integer=True, static=True)
        check_range("staleness_decay", staleness_decay, 0.0, None)
        if heartbeat_timeout_s is not None:
            check_range("heartbeat_timeout_s", heartbeat_timeout_s, 0.0, None, lo_open=True)
        if max_tokens is not None:
            check_range("max_tokens", max_tokens, 0.0, None, lo_open=True)
        if norm_bound is not None:
            check_range("norm_bound", norm_bound, 1.0, None)
        check_range("norm_window", norm_window, 1, None, integer=True, static=True)
        if adaptive_grace is not None:
            check_range("adaptive_grace", adaptive_grace, 1.0, None)
            if grace_s is None:
                raise ValueError("adaptive_grace needs grace_s (the longest window, > 0), got grace_s=None")
        if partial_rounds not in ("mean", "share"):
            raise ValueError(f"partial_rounds must be 'mean' or 'share', got {partial_rounds!r}")
        if outer is not None and not isinstance(outer, optax.GradientTransformation):
            raise ValueError(f"outer must be an optax GradientTransformation or None, got {outer!r}")
        if compressor is not None and not isinstance(compressor, optax.GradientTransformation):
            raise ValueError(f"compressor must be a compjax compressor (axis_name=None) or None, got {compressor!r}")
        if reply_compressor is not None and not isinstance(reply_compressor, optax.GradientTransformation):
            raise ValueError("reply_compressor must be a compjax compressor (axis_name=None) or None, "
                             f"got {reply_compressor!r}")
        self.learners = tuple(names)
        self.min_quorum = int(quorum)
        self.grace_s = None if grace_s is None else float(grace_s)
        self.adaptive_grace = None if adaptive_grace is None else float(adaptive_grace)
        self.partial_rounds = partial_rounds
        self._spreads = [collections.deque(maxlen=_SPREAD_HISTORY) for _ in range(int(fragments))]
        self.max_staleness = int(max_staleness)
        self.staleness_decay = float(staleness_decay)
        self.heartbeat_timeout_s = None if heartbeat_timeout_s is None else float(heartbeat_timeout_s)
        # Extra arguments (the merge's share) reach the transforms that take them; others ignore them.
        self._outer_tx = optax.with_extra_args_support(
            optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer)
        leaves, self._treedef = jax.tree.flatten(params)
        self._others = [np.array(x, copy=True) for x in leaves]  # never-synchronized leaves, as given
        self._index = fragment_assignment(params, int(fragments))
        wide = lambda x: jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)
        self._global = [[jnp.array(leaves[i], dtype=wide(leaves[i]), copy=True) for i in idx] for idx in self._index]
        self._outer = [self._outer_tx.init(g) for g in self._global]
        self._tx = wire.default_compressor() if compressor is None else compressor
        self._like = [wire.like_of(g) for g in self._global]
        self._spec = [wire.payload_spec(self._tx, like) for like in self._like]  # what each fragment's message holds
        self._reply_tx = reply_compressor
        self._reply_comm: list = []
        self._last_update: list = [None] * len(self._index)  # per fragment: (version, message) of its last merge
        self._whole_next = [False] * len(self._index)  # per fragment: its next merge replies with whole values
        self.reply_bytes = [0] * len(self._index)
        if reply_compressor is not None:
            self._reply_encode = wire.encoder(reply_compressor)
            self._reply_apply = [wire.applier(reply_compressor, like) for like in self._like]
            self._reply_comm = [reply_compressor.init(g) for g in self._global]
            for like in dict.fromkeys(self._like):  # once per distinct fragment (it compiles the encoder)
                wire.check_capturable(reply_compressor, reply_compressor.init(
                    [jnp.zeros(sh, dt) for sh, dt in like]), like)
        self._version = [0] * len(self._index)
        self._last_merged = {name: [-1] * len(self._index) for name in names}
        self._last_seq = {name: [0] * len(self._index) for name in names}  # the last sequence number taken
        self.max_tokens = None if max_tokens is None else float(max_tokens)
        self._token_cap: dict[str, float | None] = dict.fromkeys(names, self.max_tokens)
        self.norm_bound = None if norm_bound is None else float(norm_bound)
        self._norms: list[collections.deque] = [collections.deque(maxlen=int(norm_window)) for _ in self._index]
        self._rounds: list[_Round | None] = [None] * len(self._index)
        # The mean is summed one contribution at a time, so no program depends on how many contributed
        # (or on how many learners there are: a late join compiles nothing).
        self._accumulate = _ACCUMULATE
        self._outer_step = jax.jit(lambda a, o, m, s: _outer_step(self._outer_tx, a, o, m, s))
        self._sub = _SUB
        self._lock = threading.RLock()
        self.refused: list[tuple[str, int, str]] = []
        self.merges: list[tuple[int, int, tuple[str, ...]]] = []
        self.lost: list[tuple[str, float]] = []
        self._seen: dict[str, tuple[float, float]] = {}  # learner -> its last message (monotonic, wall-clock)
        self._lost: set[str] = set()
        self._left: set[str] = set()  # learners that said goodbye (until they register again)

    # --- what a learner starts from ---------------------------------------------------------------

    @property
    def fragments(self) -> int:
        """The number of fragments."""
        return len(self._index)

    def fragment_leaves(self) -> list[list[int]]:
        """Per fragment, the indices into ``jax.tree.leaves(params)`` of its leaves."""
        return [list(idx) for idx in self._index]

    def versions(self) -> list[int]:
        """Per fragment, the number of merges made of it."""
        with self._lock:
            return list(self._version)

    def last_merged(self) -> dict[str, list[int]]:
        """Per learner, per fragment: the version its last merged contribution produced (-1: none yet)."""
        with self._lock:
            return {k: list(v) for k, v in self._last_merged.items()}

    def payload_spec(self, fragment: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The shapes and dtypes of the payload arrays a contribution to ``fragment`` must carry."""
        return self._spec[fragment]

    def decode(self, fragment: int, payload) -> list[jax.Array]:
        """The outer gradient a payload of ``fragment`` encodes (one array per leaf), as the learner decoded it.

        Raises:
          ValueError: the payload's arrays are not of :meth:`payload_spec`'s shapes and dtypes.
        """
        why = self._check_payload(fragment, tuple(np.asarray(x) for x in payload))
        if why:
            raise ValueError(why)
        return wire.decoder(self._tx, self._like[fragment])(tuple(payload))

    def fragment_values(self, fragment: int) -> tuple[np.ndarray, ...]:
        """The global values of ``fragment``'s leaves (NumPy copies, float32 or wider)."""
        with self._lock:
            return tuple(np.array(x, copy=True) for x in self._global[fragment])

    def start(self, learner: str | None = None) -> Start:
        """The current global values and versions of every fragment (what a joining learner starts from).

        With ``learner`` (a known one), its ``seqs`` are the last sequence numbers taken from it.
        """
        with self._lock:
            seqs = tuple(self._last_seq[learner]) if learner in self._last_seq else ()
            return Start(tuple(tuple(np.array(x, copy=True) for x in g) for g in self._global), tuple(self._version),
                         seqs)

    def last_seqs(self) -> dict[str, list[int]]:
        """Per learner, per fragment: the last sequence number taken from it (0: none yet)."""
        with self._lock:
            return {k: list(v) for k, v in self._last_seq.items()}

    def register(self, name: str, *, max_tokens: float | None = None, now: float | None = None) -> Start:
        """Add learner ``name`` if it is new (a late join); its starting point either way.

        A new learner may contribute from then on (its first contribution is taken from the
        versions returned here, staleness 0); ``min_quorum`` stays as it was.  Registering a
        known name changes nothing (a learner reconnecting, e.g. after a syncer restart) except
        its token cap, when it declares one, and that it counts as a message (:meth:`heartbeat`).

        Args:
          name: the learner's name, a non-empty string.
          max_tokens: the most tokens one of its contributions will carry (its inner steps between
            two contributions of a fragment times its batch tokens), > 0 and at most the syncer's
            ``max_tokens``; None: the syncer's ``max_tokens`` (or the cap it declared before).
          now: the time in seconds (``time.monotonic()`` by default).

        Returns:
          :class:`Start`: the current global values and versions, and the last sequence numbers
          taken from ``name`` (its next contributions number from there).

        Raises:
          ValueError: ``name`` is not a non-empty string, or ``max_tokens`` is not a positive
            finite number at most the syncer's ``max_tokens``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if max_tokens is not None:
            check_range("max_tokens", max_tokens, 0.0, self.max_tokens, lo_open=True)
            if not math.isfinite(max_tokens):
                raise ValueError(f"max_tokens must be finite, got {max_tokens!r}")
        with self._lock:
            if max_tokens is not None:
                self._token_cap[name] = float(max_tokens)
            elif name not in self._token_cap:
                self._token_cap[name] = self.max_tokens
            if name not in self._last_merged:
                self.learners = (*self.learners, name)
                self._last_merged[name] = [-1] * self.fragments
                self._last_seq[name] = [0] * self.fragments
                logger.info("learner %r joined at versions %s", name, self._version)
            self._left.discard(name)  # back after a goodbye: counted again
            self.heartbeat(name, now=now)
            return self.start(name)

    def heartbeat(self, name: str, *, now: float | None = None) -> None:
        """Note a message from learner ``name`` (unknown names are ignored); a lost learner counts again."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if name not in self._seen and name not in self._last_merged:
                return
            self._seen[name] = (now, time.time())
            if name in self._lost:
                self._lost.discard(name)
                logger.warning("learner %r is back after it was lost", name)

    def live(self) -> tuple[str, ...]:
        """The known learners neither lost nor gone (:meth:`leave`)."""
        with self._lock:
            return tuple(k for k in self.learners if k not in self._lost and k not in self._left)

    def leave(self, name: str, *, now: float | None = None) -> list[Reply]:
        """Learner ``name`` leaves cleanly (its goodbye): rounds stop waiting for it at once, no time-out.

        The quorum shrinks as for a lost learner (``min_quorum``, or every learner still live
        when fewer are left), so an open round that the others already completed merges now.  A
        learner that registers again counts again.  Unknown names are ignored.

        Returns:
          The replies of the rounds its leave completed (:meth:`tick`'s).
        """
        with self._lock:
            if name not in self._last_merged or name in self._left:
                return []
            self._left.add(name)
            logger.info("learner %r left; live learners: %s", name, ", ".join(self.live()))
            return self.tick(now=now)

    def global_params(self) -> Any:
        """The global model in the structure of ``params``: each synchronized leaf in its own dtype."""
        with self._lock:
            out = list(self._others)
            for idx, values in zip(self._index, self._global):
                for i, x in zip(idx, values):
                    out[i] = np.array(x, dtype=self._others[i].dtype, copy=True)
            return jax.tree.unflatten(self._treedef, out)

    def state(self) -> dict:
        """The syncer's numeric state as a pytree (the arrays :meth:`save` writes).

        ``{"global": per fragment the list of global leaves, "outer": per fragment the outer
        optimizer state, "version": int32 (fragments,)}``, and with a ``reply_compressor``
        ``"reply"``: per fragment its state (e.g. the replies' error-feedback residual).  The learners and their last-merged
        counters (:meth:`last_merged`) are saved beside it, as the checkpoint's JSON metadata, so
        that a checkpoint taken after late joins restores into a syncer built with the original list.
        """
        with self._lock:
            out = {
                "global": [list(g) for g in self._global],
                "outer": list(self._outer),
                "version": np.asarray(self._version, np.int32),
            }
            if self._reply_tx is not None:
                out["reply"] = list(self._reply_comm)
            return out

    # --- contributions ------------------------------------------------------------------------------

    def admit(self, header: Header) -> str:
        """Why the contribution of ``header`` must be refused, from the header alone ('' when admissible).

        Checked in this order: the learner is known; the fragment is an integer in range; the header
        is not a shard's (``shard`` 0 of ``shards`` 1: :class:`~compjax.decoupled.ShardedSyncer` takes those); the
        declared arrays are as many as the compressor's message for the fragment holds
        (:meth:`payload_spec`) and their size no larger than that message's (before anything is
        allocated); each declared shape and dtype is the message's; the tokens are positive and finite;
        the base version exists; the sequence number is above the last one taken from this learner for
        this fragment (else a replay, refused at any ``max_staleness``); the staleness is at most
        ``max_staleness``; the learner has not contributed to the open round already.
        """
        with self._lock:
            try:
                return self._admit(header)
            except (TypeError, ValueError) as e:  # fields of the wrong types
                return f"malformed header: {e}"

    def _admit(self, header: Header) -> str:
        if header.learner not in self._last_merged:
            return f"unknown learner {header.learner!r} (known: {', '.join(self.learners)})"
        p = header.fragment
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not 0 <= p < self.fragments:
            return f"wrong fragment {p!r}: fragments are 0 to {self.fragments - 1}"
        if (header.shard, header.shards) != (0, 1):
            return (f"shard {header.shard!r} of {header.shards!r}: this syncer holds the whole model, not shards "
                    f"(a sharded learner's syncer is compjax.decoupled.ShardedSyncer)")
        want = self._spec[p]
        if len(header.shapes) != len(want) or len(header.dtypes) != len(want):
            return (f"wrong size: the message of fragment {p} has {len(want)} arrays, the header declares "
                    f"{len(header.shapes)} shapes and {len(header.dtypes)} dtypes")
        limit = sum(x.size * np.dtype(x.dtype).itemsize for x in want)
        try:
            declared = header.array_bytes()
        except (ValueError, TypeError) as e:
            return f"wrong shape or dtype: {e}"
        if declared > limit:
            return f"wrong size: {declared} bytes declared, the message of fragment {p} holds {limit}"
        for j, (shape, dtype, x) in enumerate(zip(header.shapes, header.dtypes, want)):
            if tuple(shape) != tuple(x.shape) or np.dtype(dtype) != np.dtype(x.dtype):
                return (f"wrong shape or dtype of array {j}: {tuple(shape)} {np.dtype(dtype)}, the message of "
                        f"fragment {p} has {tuple(x.shape)} {np.dtype(x.dtype)}")
        if not (isinstance(header.tokens, (int, float, np.number)) and math.isfinite(header.tokens)
                and header.tokens > 0):
            return f"tokens must be positive and finite, got {header.tokens!r}"
        cap = self._token_cap.get(header.learner)
        if cap is not None and header.tokens > cap:
            return f"tokens {header.tokens!r} above the {cap!r} per contribution learner {header.learner!r} declared"
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                   for v in (header.base_version, header.step, header.payload_bytes, header.seq)):
            return "malformed header: base_version, step, payload_bytes and seq must be integers"
        tau = self._version[p] - header.base_version
        if header.base_version < 0 or tau < 0:
            return f"base version {header.base_version} of fragment {p} does not exist (now {self._version[p]})"
        last = self._last_seq[header.learner][p]
        if header.seq <= last:
            return (f"replayed: sequence number {header.seq} is not above {last}, the last taken from learner "
                    f"{header.learner!r} for fragment {p}")
        if tau > self.max_staleness:
            return f"stale: staleness {tau} > max_staleness {self.max_staleness}"
        r = self._rounds[p]
        if r is not None and header.learner in r.entries:
            return f"learner {header.learner!r} already contributed to the open round of fragment {p}"
        return ""

    def submit(self, contribution: Contribution, *, now: float | None = None) -> list[Reply]:
        """Take one contribution whose arrays are already in memory (see :meth:`handle`)."""
        values = contribution.values
        return self.handle(Incoming(contribution.header, lambda: values), now=now)

    def handle(self, incoming: Incoming, *, now: float | None = None) -> list[Reply]:
        """Check a contribution's header, pull its arrays if admitted, check them, add it to its round.

        Args:
          incoming: the header and the ``pull`` of its arrays (:class:`Incoming`).
          now: the time in seconds (``time.monotonic()`` by default), which opens the round.

        Returns:
          The replies to send: a refusal to a known learner, or, when this contribution
          completes the quorum, the merged fragment to each contributor ([] otherwise).
        """
        h = incoming.header
        now = time.monotonic() if now is None else now
        with self._lock:
            if isinstance(h.learner, str):
                self.heartbeat(h.learner, now=now)
            why = self.admit(h)
            if not why:
                try:
                    values = tuple(np.asarray(x) for x in incoming.pull())
                except Exception as e:  # noqa: BLE001 - a failed receive refuses this contribution only
                    why = f"could not receive the arrays: {type(e).__name__}: {e}"
                else:
                    why = self._check_payload(h.fragment, values)
                if not why:  # the outer gradient the payload encodes; never a non-finite one in the model
                    values = tuple(wire.decoder(self._tx, self._like[h.fragment])(values))
                    why = self._check_finite(values)
                if not why:
                    norm = _norm(values)
                    why = self._check_norm(h.fragment, norm)
            if why:
                return self._refuse(h, why)
            p = h.fragment
            tau = self._version[p] - h.base_version
            weight = float(h.tokens) * math.exp(-self.staleness_decay * tau)
            if self._rounds[p] is None:
                self._rounds[p] = _Round(opened=now)
            self._rounds[p].entries[h.learner] = (weight, values, tau, norm, float(h.tokens))
            self._rounds[p].arrived.append(now)
            self._last_seq[h.learner][p] = int(h.seq)  # taken: the same number again is a replay
            if len(self._rounds[p].entries) >= self._quorum():
                return self._merge_round(p, "quorum")
            return []

    def _quorum(self) -> int:
        """Contributions that merge a round now: ``min_quorum`` (or ``quorum_fraction`` of the live learners), or
        fewer when learners were lost or left."""
        live = len(self.learners) - len(self._lost | self._left)
        if self.quorum_fraction is not None:
            return max(1, min(live, math.ceil(self.quorum_fraction * live - 1e-9)))
        return max(1, min(self.min_quorum, live))

    def _check_lost(self, now: float) -> None:
        if self.heartbeat_timeout_s is None:
            return
        for name in self.learners:
            if name not in self._seen or name in self._lost or name in self._left:
                continue  # not heard from yet (starting up): the grace window bounds the wait for it
            last, wall = self._seen[name]
            if now - last > self.heartbeat_timeout_s:
                self._lost.add(name)
                self.lost.append((name, wall))
                when = datetime.datetime.fromtimestamp(wall, datetime.UTC).isoformat(timespec="milliseconds")
                logger.warning("learner %r lost: no message for %.1f s (last at %s)", name, now - last, when)

    def tick(self, *, now: float | None = None) -> list[Reply]:
        """Declare silent learners lost; merge every open round whose grace window ended or whose quorum is met.

        The quorum is ``min_quorum``, or every learner not lost when fewer are left.  Returns the
        replies to send.
        """
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            self._check_lost(now)
            for p, r in enumerate(self._rounds):
                if r is None:
                    continue
                if len(r.entries) >= self._quorum():
                    out += self._merge_round(p, "quorum")
                elif self.grace_s is not None and now - r.opened >= self._grace(p):
                    out += self._merge_round(p, "grace window")
        return out

    def next_deadline(self) -> float | None:
        """The time (``time.monotonic`` clock) at which the earliest open round's grace window ends, or None."""
        with self._lock:
            if self.grace_s is None:
                return None
            ends = [r.opened + self._grace(p) for p, r in enumerate(self._rounds) if r is not None]
            return min(ends) if ends else None

    def grace(self, fragment: int) -> float | None:
        """The grace window (seconds) a round of ``fragment`` opened now would have; None: no limit.

        Raises:
          ValueError: ``fragment`` not in [0, fragments).
        """
        check_range("fragment", fragment, 0, self.fragments - 1, integer=True, static=True)
        with self._lock:
            return self._grace(fragment)

    def _grace(self, p: int) -> float | None:
        """``grace_s``, or with ``adaptive_grace`` ``c``: ``min(grace_s, c x`` the 90th percentile of the spreads of
        fragment ``p``'s last merged rounds with 2 or more contributions) (``grace_s`` before there are any)."""
        if self.grace_s is None or self.adaptive_grace is None or not self._spreads[p]:
            return self.grace_s
        return min(self.grace_s, self.adaptive_grace * float(np.percentile(list(self._spreads[p]), 90)))

    def _check_payload(self, p: int, values: tuple) -> str:
        want = self._spec[p]
        if len(values) != len(want):
            return f"wrong size: {len(values)} arrays received, the message of fragment {p} has {len(want)}"
        for j, (v, x) in enumerate(zip(values, want)):
            if v.shape != tuple(x.shape) or v.dtype != np.dtype(x.dtype):
                return (f"wrong shape or dtype of array {j}: received {v.shape} {v.dtype}, the message has "
                        f"{tuple(x.shape)} {np.dtype(x.dtype)}")
        return ""

    def _check_norm(self, p: int, norm: float) -> str:
        """Why a decoded outer gradient of L2 norm ``norm`` is too large for fragment ``p`` ('' if it is not)."""
        recent = [x for x in self._norms[p] if x > 0.0]
        if self.norm_bound is None or not recent:
            return ""
        limit = self.norm_bound * float(np.median(recent))
        if norm > limit:
            return (f"norm {norm:.4g} of the outer gradient above {self.norm_bound:g} x {limit / self.norm_bound:.4g}, "
                    f"the median of fragment {p}'s last {len(recent)} merged norms")
        return ""

    @staticmethod
    def _check_finite(decoded: tuple) -> str:
        for j, v in enumerate(decoded):
            if not bool(jnp.all(jnp.isfinite(v))):
                return f"non-finite value in the decoded leaf {j}"
        return ""

    def _refuse(self, h: Header, why: str) -> list[Reply]:
        logger.warning("refused the contribution of learner %r to fragment %r: %s", h.learner, h.fragment, why)
        self.refused.append((h.learner, h.fragment, why))
        if not isinstance(h.learner, str) or h.learner not in self._last_merged:
            return []
        ok = (isinstance(h.fragment, (int, np.integer)) and not isinstance(h.fragment, bool)
              and 0 <= h.fragment < self.fragments)
        stale = why.startswith("stale")  # the learner catches up from the current global values
        version = self._version[h.fragment] if ok else -1
        last = self._last_update[h.fragment] if ok else None
        if stale and last is not None and last[0] == version and h.base_version == version - 1:
            # One merge behind: the last merge's compressed update brings its anchor to the current values.
            self.reply_bytes[h.fragment] += last[2]
            return [Reply(h.learner, int(h.fragment), version, None, accepted=False, reason=why, update=last[1])]
        values = tuple(np.array(x, copy=True) for x in self._global[h.fragment]) if ok and stale else None
        return [Reply(h.learner, int(h.fragment) if ok else -1, version, values, accepted=False, reason=why)]

    def _merge_round(self, p: int, why: str) -> list[Reply]:
        r = self._rounds[p]
        self._rounds[p] = None
        if len(r.arrived) >= 2:  # the spread of the arrivals: what the adaptive grace window learns from
            self._spreads[p].append(max(r.arrived) - r.opened)
        names = list(r.entries)  # arrival order: the record and the replies
        order = sorted(names)  # the sum's order: the merge does not depend on which contribution came first
        tokens = [r.entries[k][4] for k in order]
        total = math.fsum(tokens)
        share = 1.0  # of a full round: what an outer optimizer such as delayed_nesterov counts
        if self.partial_rounds == "share":  # the round's share of the declared tokens of the learners not lost
            mean = total / len(tokens)
            members = {k for k in self.learners if k not in self._lost} | set(order)  # those that left included
            full = math.fsum(self._token_cap.get(k) or mean for k in sorted(members))
            share = min(1.0, total / full) if full > 0 else 1.0
            total = max(total, full)
        new, outer_state = self._merge(p, [r.entries[k][1] for k in order], [r.entries[k][0] for k in order], total,
                                       share)
        if not (_all_finite(new) and _all_finite(outer_state)):
            return self._refuse_round(p, names)
        self._norms[p].extend(r.entries[k][3] for k in order)
        update = None
        if self._reply_tx is not None:  # the global values move by exactly the decoded message sent
            update, new = self._encode_update(p, list(new))
        self._global[p], self._outer[p] = list(new), outer_state
        self._version[p] += 1
        if update is not None:
            self._last_update[p] = (self._version[p], update, self._reply_message_bytes)
        for k in names:
            self._last_merged[k][p] = self._version[p]
        self.merges.append((p, self._version[p], tuple(names)))
        logger.info("merged fragment %d (version %d) from %s (%s)", p, self._version[p], ", ".join(names), why)
        values = tuple(np.array(x, copy=True) for x in new)
        whole, self._whole_next[p] = self._whole_next[p], False
        replies = []
        for k in names:
            if update is not None and r.entries[k][2] == 0 and not whole:  # its anchor: the version before
                self.reply_bytes[p] += self._reply_message_bytes
                replies.append(Reply(k, p, self._version[p], None, update=update))
            else:
                replies.append(Reply(k, p, self._version[p], values))
        return replies

    def _refuse_round(self, p: int, names: list) -> list[Reply]:
        """A merge whose result is not finite: nothing changes; each contributor refused with the current values."""
        why = (f"merge refused: the merged values or the outer optimizer state of fragment {p} would not be finite; "
               f"the global model stays at version {self._version[p]}")
        logger.warning("fragment %d: %s (contributors: %s)", p, why, ", ".join(names))
        values = tuple(np.array(x, copy=True) for x in self._global[p])
        for k in names:
            self.refused.append((k, p, why))
        return [Reply(k, p, self._version[p], values, accepted=False, reason=why) for k in names]

    def _merge(self, p: int, decoded: list, weights: list, total: float | None = None,
               share: float = 1.0) -> tuple[list, Any]:
        """``sum w_i m_i / total`` of ``decoded`` (in this order; ``total`` the undiscounted tokens ``sum n_i``, or
        more with ``partial_rounds='share'``; default ``sum w_i``), then the outer step (told the round's ``share``
        of a full one): new values and state."""
        total = math.fsum(weights) if total is None else total
        acc = [np.zeros(g.shape, np.float32) for g in self._global[p]]
        for d, w in zip(decoded, weights):
            acc = self._accumulate(acc, d, np.float32(w / total))
        new, state = self._outer_step(self._global[p], self._outer[p], acc, np.float32(share))
        return list(new), state

    def warm_up(self) -> None:
        """Compile what receiving and merging run, for every fragment, on zeros; no state changes.

        No program depends on the number of contributions or of learners, so nothing compiles later
        (a late join included).

        A merge otherwise compiles on first use, once per fragment (decoding, the merge, the reply
        codec), inside the first round: every learner waiting for that round's reply waits for the
        compiles too.  Call it before the learners start (a restart: before serving again).  Every
        learner heard before counts as heard when it ends: a restored syncer does not declare lost
        the learners that were silent only because it was compiling.
        """
        with self._lock:
            for p in range(self.fragments):
                payload = tuple(np.zeros(x.shape, x.dtype) for x in self._spec[p])
                decoded = tuple(wire.decoder(self._tx, self._like[p])(payload))
                self._check_finite(decoded)
                new, _ = self._merge(p, [decoded], [1.0])
                if self._reply_tx is not None:
                    delta = self._sub(list(new), self._global[p])
                    update = self._reply_encode(delta, self._reply_comm[p])[2]
                    new = self._reply_apply[p](self._global[p], tuple(np.asarray(x) for x in update))
                jax.block_until_ready(new)
            # Learners are not judged on the silence the compiles caused: they count as heard now.
            now = time.monotonic()
            self._seen = {k: (now, time.time()) for k in self._seen}

    def _encode_update(self, p: int, new: list) -> tuple[tuple[np.ndarray, ...], list]:
        """The reply compressor's message of ``new - global`` and the global values it decodes to."""
        old = self._global[p]
        delta = self._sub(new, old)
        _, comm, payload, skipped = self._reply_encode(delta, self._reply_comm[p])
        if bool(skipped):  # a non-finite update (the guard skipped it): the message of zeros, nothing applied
            zeros = [jnp.zeros_like(o) for o in old]
            payload = self._reply_encode(zeros, self._reply_tx.init(zeros))[2]
            logger.warning("fragment %d: the merged update is not finite; the global values stay", p)
        else:
            self._reply_comm[p] = comm
        update = tuple(np.asarray(x) for x in payload)
        # The compressor's own count (equal to the arrays' bytes: checked when the syncer was built).
        self._reply_message_bytes = sum(int(x.nbytes) for x in update) if bool(skipped) else message_bytes(comm)
        return update, list(self._reply_apply[p](old, update))

    # --- running and checkpoints --------------------------------------------------------------------

    def serve(self, transport: Transport, stop: threading.Event, *, poll_s: float = 0.05) -> None:
        """Receive, merge and reply until ``stop`` is set (run it in a thread of its own).

        Args:
          transport: where contributions come from and replies go.
          stop: set it to end the loop (within ``poll_s`` seconds).
          poll_s: the longest wait for a contribution before the loop checks ``stop`` and the
            grace windows again, > 0.
        """
        check_range("poll_s", poll_s, 0.0, None, lo_open=True)
        transport.attach(self)
        while not stop.is_set():
            deadline = self.next_deadline()
            wait = poll_s if deadline is None else min(poll_s, max(0.0, deadline - time.monotonic()))
            incoming = transport.receive(timeout=wait)
            # Everything already queued is taken before the grace windows and the heartbeats are checked:
            # after a long merge (a first compile) the learners' queued messages count as heard now.
            for _ in range(256):
                if incoming is None or stop.is_set():
                    break
                for reply in self.handle(incoming):
                    transport.reply(reply)  # at once: a transport pairs a refusal with the header it answers
                incoming = transport.receive(timeout=0.0)
            for reply in self.tick():
                transport.reply(reply)

    def save(self, directory: str | Path, step: int) -> None:
        """Write :meth:`state` to ``directory`` as checkpoint ``step`` with orbax (waits until it is on disk).

        Open rounds are not saved: their contributions are lost with a restart (learners send again).

        Raises:
          ValueError: ``step`` < 0 or not newer than the latest checkpoint in ``directory``.
        """
        from compjax.checkpoint import Checkpointer  # orbax stays out of ``import compjax``

        with self._lock, Checkpointer(directory) as ckpt:
            ckpt.save(int(step), self.state(), extra={"learners": list(self.learners),
                                                      "last_merged": self.last_merged(),
                                                      "last_seq": self.last_seqs(),
                                                      "lost": sorted(self._lost), "left": sorted(self._left),
                                                      "token_cap": dict(self._token_cap)})

    def restore(self, directory: str | Path, *, step: int | None = None) -> int:
        """Load a checkpoint of :meth:`save` into this syncer (built with the same arguments); its step.

        The global parameters, outer state, versions, last-merged counters and last sequence
        numbers taken come back bit-identical (contributions taken after the checkpoint may be sent
        again: they were lost with the syncer), and so do the membership and the token caps: a learner lost
        or gone (:meth:`leave`) when the checkpoint was written stays lost or gone until it is heard from again,
        every other one counts as just seen; open rounds are dropped.
        With a ``reply_compressor``, each fragment's first merge after the restore replies with whole values,
        not the compressed update, so every contributor's anchor is set to the global values once (updates move
        an anchor by what they carry, so an anchor a restart left off the global values would stay off: a
        benchmark run whose syncer restarted ended 71% above one with whole-value replies).
        The checkpoint's learners may be more than this syncer's (learners that joined late):
        they are registered, in the checkpoint's order.

        Raises:
          FileNotFoundError: no checkpoint in ``directory`` (or not ``step``).
          ValueError: a learner of this syncer that the checkpoint does not have, or the
            checkpoint's fragments, leaf shapes or dtypes or outer state differ from this syncer's.
        """
        from compjax.checkpoint import Checkpointer

        with self._lock, Checkpointer(directory) as ckpt:
            step = ckpt.latest_step() if step is None else int(step)
            state, extra = ckpt.restore(self.state(), step=step)
            saved = list(extra.get("learners", []))
            missing = [k for k in self.learners if k not in saved]
            if missing:
                raise ValueError(f"the checkpoint's learners {saved} lack this syncer's {missing}: build the syncer "
                                 f"with learners from the checkpoint's list (later ones join with register)")
            self._global = [list(g) for g in state["global"]]
            self._outer = list(state["outer"])
            if self._reply_tx is not None:
                self._reply_comm = list(state["reply"])
            self._version = [int(v) for v in np.asarray(state["version"])]
            self.learners = tuple(saved)
            self._last_merged = {k: [int(v) for v in extra["last_merged"][k]] for k in saved}
            seqs = extra.get("last_seq", {})
            self._last_seq = {k: [int(v) for v in seqs.get(k, [0] * self.fragments)] for k in saved}
            self._rounds = [None] * self.fragments
            self._last_update = [None] * self.fragments  # not checkpointed: stale learners get whole values
            # Each fragment's first merge after a restart replies with whole values: a learner's anchor that a
            # restart left off the global values (updates only move it by the same amounts) is set right once.
            self._whole_next = [True] * self.fragments
            # Membership as it was: a learner lost or gone before the checkpoint stays so (until it is heard
            # from again); every other one counts as just seen.  Token caps as declared.
            self._lost = set(extra.get("lost", [])) & set(saved)
            self._left = set(extra.get("left", [])) & set(saved)
            caps = extra.get("token_cap", {})
            self._token_cap = {k: (None if caps.get(k, self.max_tokens) is None else float(caps.get(k, self.max_tokens)))
                               for k in saved}
            now = time.monotonic()
            self._seen = {k: (now, time.time()) for k in saved if k not in self._lost | self._left}
            return int(step)
