"""A learner that is itself a sharded program: contributions and replies shard by shard, never gathered.

A learner whose training step runs on a mesh of several devices (e.g. an ``fsdp`` axis: each device
holds a slice of each large parameter) sends each fragment's outer gradient as one contribution
*per shard*: shard ``s`` is what mesh device ``s`` (in the mesh's row-major device order) holds of
the parameters, and its contribution carries only those slices, taken on that device
(:attr:`Header.shard <compjax.decoupled.Header.shard>` of :attr:`Header.shards
<compjax.decoupled.Header.shards>`).  A leaf that several devices hold whole (a small leaf, a
replicated one) belongs to the first of them.  The syncer keeps the global model and the outer
optimizer per shard on the host (:class:`ShardedSyncer`: one :class:`~compjax.decoupled.Syncer` per
shard; DiLoCo's outer steps -- SGD, Nesterov, Adam -- are elementwise, so per-shard outer steps are
exactly the whole model's), merges each shard's round on its own and replies per shard; the learner
rebuilds each leaf from its devices' slices with ``jax.make_array_from_single_device_arrays``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax._checks import check_range
from compjax.decoupled.learner import LearnerStats
from compjax.decoupled.messages import Contribution, Header, Reply, Start
from compjax.decoupled.syncer import Syncer
from compjax.decoupled.transport import Incoming, Transport

logger = logging.getLogger("compjax.decoupled")


def _key(index: tuple, shape: tuple) -> tuple:
    """A hashable form of a device's index into a leaf (slices normalized to ``(start, stop)``)."""
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which slice of which leaf each shard holds.

    Attributes:
      shapes: the global shape of each floating-point leaf taking part (in ``jax.tree.leaves`` order).
      leaves: the positions of those leaves among all leaves.
      owned: per shard, its pieces ``(j, index)``: leaf ``j`` of ``shapes`` and the tuple of slices it holds.
    """

    shapes: tuple[tuple[int, ...], ...]
    leaves: tuple[int, ...]
    owned: tuple[tuple[tuple[int, tuple], ...], ...]

    @property
    def shards(self) -> int:
        """The number of shards (the devices of the mesh)."""
        return len(self.owned)

    @classmethod
    def of(cls, params: Any) -> "ShardLayout":
        """The layout of ``params``, a pytree of ``jax.Array`` leaves placed with a ``NamedSharding`` over one mesh.

        Raises:
          ValueError: a floating-point leaf not a ``jax.Array`` with a ``NamedSharding``, leaves on
            different meshes, or a mesh with devices this process cannot address.
        """
        mesh, shapes, positions, owned = None, [], [], None
        for i, x in enumerate(jax.tree.leaves(params)):
            if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) or np.size(x) == 0:
                continue
            sharding = getattr(x, "sharding", None)
            if not isinstance(sharding, jax.sharding.NamedSharding):
                raise ValueError(f"params: leaf {i} must be a jax.Array with a NamedSharding, got "
                                 f"{type(sharding).__name__}")
            if mesh is None:
                mesh = sharding.mesh
                devices = list(mesh.devices.flat)
                if not all(d.process_index == jax.process_index() for d in devices):
                    raise ValueError("params: the mesh must hold only this process's devices (one learner, one process)")
                owned = [[] for _ in devices]
            elif sharding.mesh.devices.shape != mesh.devices.shape or list(sharding.mesh.devices.flat) != devices:
                raise ValueError(f"params: leaf {i} is on another mesh than leaf {positions[0]}")
            j = len(shapes)
            shapes.append(tuple(x.shape))
            positions.append(i)
            taken = set()
            for s, (d, index) in enumerate((d, sharding.devices_indices_map(x.shape)[d]) for d in devices):
                k = _key(index, x.shape)
                if k not in taken:  # a slice several devices hold belongs to the first of them
                    taken.add(k)
                    owned[s].append((j, tuple(slice(a, b) for a, b in k)))
        if mesh is None:
            raise ValueError("params holds no floating-point leaf to synchronize")
        return cls(tuple(shapes), tuple(positions), tuple(tuple(o) for o in owned))

    def split(self, values: Sequence) -> list[list[np.ndarray]]:
        """Per shard, its slices of ``values`` (the global leaves of ``shapes``, NumPy; copies)."""
        return [[np.array(np.asarray(values[j])[index], copy=True) for j, index in own] for own in self.owned]

    def join(self, pieces: Sequence[Sequence]) -> list[np.ndarray]:
        """The global leaves from every shard's slices (the inverse of :meth:`split`)."""
        out = [None] * len(self.shapes)
        for own, values in zip(self.owned, pieces):
            for (j, index), v in zip(own, values):
                if out[j] is None:
                    out[j] = np.zeros(self.shapes[j], np.asarray(v).dtype)
                out[j][index] = np.asarray(v)
        return out


class ShardedSyncer:
    r"""The syncer of sharded learners: one :class:`~compjax.decoupled.Syncer` per shard, on the host.

    Shard ``s`` of the global model is the slices that device ``s`` of a learner's mesh holds
    (:class:`ShardLayout`; every learner has the same layout).  Its :class:`Syncer` holds those
    slices' global values and outer optimizer state; a contribution with :attr:`Header.shard
    <compjax.decoupled.Header.shard>` ``= s`` goes to it and is merged with the other learners'
    contributions of shard ``s`` (the rules of :class:`~compjax.decoupled.Syncer`: quorum, grace
    window, staleness, sequence numbers, token caps, the norm bound -- over the shard's norm --,
    the finite merge check), and its replies carry ``shard = s``.  The outer optimizers DiLoCo
    uses (SGD, Nesterov momentum, Adam) act entry by entry, so the shards' outer steps together
    are the whole model's: at full quorum the result is :func:`compjax.diloco`'s global
    parameters.  Outer optimizers that couple entries (e.g. a global-norm clip) are not.

    Args:
      params: the initial global parameters (a pytree of arrays, as one learner's ``params`` but
        unsharded, e.g. NumPy).
      layout: the learners' :class:`ShardLayout` (``ShardLayout.of(learner_params)``).
      learners: the names of the learners allowed to contribute.
      **kwargs: the other arguments of :class:`~compjax.decoupled.Syncer` (``outer``, ``min_quorum``,
        ``grace_s``, ``max_staleness``, ...), the same for every shard; ``fragments`` must be 1 and
        ``compressor`` and ``reply_compressor`` None (float32 outer gradients and whole values).

    Attributes:
      shards: the per-shard :class:`~compjax.decoupled.Syncer`\ s.
      refused: ``(learner, shard, reason)`` of every contribution refused for its shard fields.

    Raises:
      ValueError: ``params`` whose floating-point leaves do not have ``layout``'s shapes, or
        ``fragments``, ``compressor`` or ``reply_compressor`` given.

    References:
      Douillard et al., "DiLoCo", 2023 (the outer step); Douillard et al., "Decoupled DiLoCo",
      arXiv 2604.21428 (learners that are datacenters, a syncer).

    Examples:
      >>> import jax, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
      >>> w = jax.device_put(np.zeros((4, 3), np.float32), NamedSharding(mesh, P("fsdp")))
      >>> layout = ShardLayout.of({"w": w})
      >>> [[i for _, i in own] for own in layout.owned]
      [[(slice(0, 2, None), slice(0, 3, None))], [(slice(2, 4, None), slice(0, 3, None))]]
      >>> ShardedSyncer({"w": np.zeros((4, 3), np.float32)}, layout, learners=["a"]).versions()
      [0, 0]
    """

    def __init__(self, params: Any, layout: ShardLayout, *, learners: Sequence[str], **kwargs):
        for name, allowed in (("fragments", 1), ("compressor", None), ("reply_compressor", None)):
            if kwargs.get(name, allowed) != allowed:
                raise ValueError(f"ShardedSyncer: {name} must be {allowed} (one fragment, float32 outer "
                                 f"gradients, whole values in replies), got {kwargs[name]!r}")
        leaves, self._treedef = jax.tree.flatten(params)
        self._leaves = [np.asarray(x) for x in leaves]
        got = tuple(tuple(np.shape(self._leaves[i])) for i in layout.leaves)
        if got != layout.shapes:
            raise ValueError(f"params: the synchronized leaves' shapes {got} are not the layout's {layout.shapes}")
        self.layout = layout
        pieces = layout.split([self._leaves[i] for i in layout.leaves])
        self.shards = [Syncer(list(p), learners=learners, **kwargs) for p in pieces]
        self.refused: list[tuple[str, int, str]] = []
        self._lock = threading.Lock()

    @property
    def learners(self) -> tuple[str, ...]:
        return self.shards[0].learners

    def versions(self) -> list[int]:
        """Per shard, the number of merges made of it."""
        return [s.versions()[0] for s in self.shards]

    def _start(self, starts: list) -> Start:
        """One :class:`~compjax.decoupled.Start` whose entries are the shards (values, version, sequence number)."""
        return Start(tuple(st.values[0] for st in starts), tuple(st.versions[0] for st in starts),
                     tuple(st.seqs[0] for st in starts) if all(st.seqs for st in starts) else ())

    def start(self, learner: str | None = None) -> Start:
        """Where a learner starts: a :class:`~compjax.decoupled.Start` with one entry per *shard* (not fragment):
        the shard's global values, version and the learner's last sequence number
        (:meth:`ShardedLearner.start_from` reads it so)."""
        return self._start([s.start(learner) for s in self.shards])

    def register(self, name: str, *, max_tokens: float | None = None, now: float | None = None) -> Start:
        """:meth:`Syncer.register <compjax.decoupled.Syncer.register>` on every shard; the start per shard.

        ``max_tokens`` caps each shard's contributions (every shard of one send carries the send's tokens).

        Raises:
          ValueError: as :meth:`Syncer.register <compjax.decoupled.Syncer.register>`.
        """
        return self._start([s.register(name, max_tokens=max_tokens, now=now) for s in self.shards])

    def heartbeat(self, name: str, *, now: float | None = None) -> None:
        """Note a message from learner ``name`` on every shard."""
        for s in self.shards:
            s.heartbeat(name, now=now)

    def leave(self, name: str, *, now: float | None = None) -> list[Reply]:
        """Learner ``name`` leaves cleanly, on every shard; the replies of the rounds its leave completed."""
        return [dataclasses.replace(r, shard=k) for k, s in enumerate(self.shards) for r in s.leave(name, now=now)]

    def global_params(self) -> Any:
        """The global model in the structure of ``params``, each leaf whole (NumPy, its own dtype)."""
        out = list(self._leaves)
        joined = self.layout.join([s.global_params() for s in self.shards])
        for i, x in zip(self.layout.leaves, joined):
            out[i] = x.astype(self._leaves[i].dtype)
        return jax.tree.unflatten(self._treedef, out)

    def handle(self, incoming: Incoming, *, now: float | None = None) -> list[Reply]:
        """Route a contribution to its shard's syncer (a wrong ``shard``/``shards`` is refused); the replies."""
        h = incoming.header
        n = self.layout.shards
        if (h.shards != n or isinstance(h.shard, bool) or not isinstance(h.shard, (int, np.integer))
                or not 0 <= h.shard < n):
            why = f"shard {h.shard!r} of {h.shards!r}: this syncer holds shards 0..{n - 1} of {n}"
            logger.warning("refused the contribution of learner %r: %s", h.learner, why)
            with self._lock:
                self.refused.append((h.learner, h.shard, why))
            known = isinstance(h.learner, str) and h.learner in self.learners
            return [Reply(h.learner, -1, -1, None, accepted=False, reason=why)] if known else []
        inner = Incoming(dataclasses.replace(h, shard=0, shards=1), incoming.pull)  # the shard's syncer: whole
        return [dataclasses.replace(r, shard=h.shard) for r in self.shards[h.shard].handle(inner, now=now)]

    def submit(self, contribution: Contribution, *, now: float | None = None) -> list[Reply]:
        """Take one contribution whose arrays are already in memory (see :meth:`handle`)."""
        values = contribution.values
        return self.handle(Incoming(contribution.header, lambda: values), now=now)

    def tick(self, *, now: float | None = None) -> list[Reply]:
        """Every shard's :meth:`Syncer.tick <compjax.decoupled.Syncer.tick>`, its replies marked with the shard."""
        return [dataclasses.replace(r, shard=s) for s, syncer in enumerate(self.shards) for r in syncer.tick(now=now)]

    def next_deadline(self) -> float | None:
        """The earliest grace-window end over the shards (``time.monotonic`` clock), or None."""
        deadlines = [d for d in (s.next_deadline() for s in self.shards) if d is not None]
        return min(deadlines) if deadlines else None

    def warm_up(self) -> None:
        """Every shard's :meth:`Syncer.warm_up <compjax.decoupled.Syncer.warm_up>`."""
        for s in self.shards:
            s.warm_up()

    serve = Syncer.serve


class ShardedLearner:
    r"""A learner whose step runs on a mesh of its own devices; its outer gradients leave shard by shard.

    Its ``params`` are ``jax.Array``\ s placed with ``NamedSharding``\ s over one mesh of this
    process's devices (e.g. an ``fsdp`` axis of 4 devices: :func:`compjax.parallel.fsdp_specs`),
    and ``train_step`` keeps them so.  Every ``sync_every`` inner steps, for each shard ``s``
    (:class:`ShardLayout`: the slices device ``s`` holds), the learner takes the outer gradient
    ``Δ_s = θ^g_s − θ_s`` on device ``s`` from that device's own slices (float32), and sends it as
    one contribution, ``Header(shard=s, shards=S)`` with one float32 buffer of its slices raveled and
    concatenated (the message :func:`compjax.identity` encodes), the array still on device ``s``:
    no parameter is ever gathered on one device.  The sequence number is per learner and
    fragment, the same for the ``S`` contributions of one send (each shard's syncer checks its
    own).  Each shard's reply, the shard's merged values ``θ̃_s``, becomes the shard's anchor and
    is mixed in on its devices, ``θ_s ← α θ_s + (1 − α) θ̃_s`` (``θ_s ← θ̃_s`` with
    ``wait_for_merge``), and every leaf is rebuilt from its devices' arrays with
    ``jax.make_array_from_single_device_arrays``.  Against a :class:`ShardedSyncer` with a full
    quorum and every learner waiting, the system computes :func:`compjax.diloco`'s global
    parameters on a ``data x fsdp`` mesh.

    Only one fragment and float32 outer gradients (no compressor) for now; a fragment is never
    sent twice at once (a due send waits for the previous replies of all shards).

    Args:
      name: this learner's name.
      train_step: ``(params, inner_state, batch) -> (params, inner_state, loss)`` on the mesh.
      params: the initial parameters, sharded (see above), equal to the syncer's global ones.
      inner_state: the inner optimizer's state.
      transport: where contributions go and replies come from.
      sync_every: ``H``, inner steps between two sends, an integer >= 1.
      alpha: weight of the local parameters in the merge, in [0, 1] (unused with ``wait_for_merge``).
      wait_for_merge: block after each send until every shard's merged values came back.
      reply_timeout_s: the longest wait for one reply, > 0, or None (forever).
      max_tokens: tokens of one contribution are clipped to this cap, > 0, or None.

    Attributes:
      params, inner_state, count: as :class:`~compjax.decoupled.Learner`'s.
      layout: the :class:`ShardLayout` of ``params``.
      stats: :class:`~compjax.decoupled.LearnerStats` (one fragment; ``bytes_sent`` sums the shards').

    Raises:
      ValueError: an argument outside the ranges above, or ``params`` not sharded over one mesh
        of this process's devices (:meth:`ShardLayout.of`).
      TimeoutError: (from :meth:`step` and :meth:`finish`) no reply within ``reply_timeout_s``.

    References:
      Douillard et al., "Decoupled DiLoCo", arXiv 2604.21428 (each learner a datacenter's program);
      Douillard et al., "DiLoCo", 2023.

    Examples:
      >>> import jax, numpy as np, optax, threading
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> from compjax.decoupled import InProcessTransport, ShardLayout, ShardedLearner, ShardedSyncer
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
      >>> w = jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, P("fsdp")))
      >>> step = jax.jit(lambda p, s, t: ({"w": p["w"] - 0.5 * (p["w"] - t)}, s, 0.0))
      >>> transport = InProcessTransport(["a"])
      >>> syncer = ShardedSyncer({"w": np.ones((4, 2), np.float32)}, ShardLayout.of({"w": w}), learners=["a"],
      ...                        outer=optax.sgd(1.0))
      >>> stop = threading.Event()
      >>> server = threading.Thread(target=syncer.serve, args=(transport, stop)); server.start()
      >>> learner = ShardedLearner("a", step, {"w": w}, (), transport, sync_every=2, wait_for_merge=True)
      >>> for _ in range(2):
      ...     _ = learner.step(0.0)
      >>> learner.finish(); stop.set(); server.join()
      >>> syncer.global_params()["w"][0], learner.params["w"].sharding.shard_shape((4, 2))
      (array([0.25, 0.25], dtype=float32), (2, 2))
    """

    def __init__(self, name: str, train_step: Callable, params: Any, inner_state: Any, transport: Transport, *,
                 sync_every: int, alpha: float = 0.5, wait_for_merge: bool = False,
                 reply_timeout_s: float | None = None, max_tokens: float | None = None):
        check_range("sync_every", sync_every, 1, None, integer=True, static=True)
        check_range("alpha", alpha, 0.0, 1.0)
        if reply_timeout_s is not None:
            check_range("reply_timeout_s", reply_timeout_s, 0.0, None, lo_open=True)
        if max_tokens is not None:
            check_range("max_tokens", max_tokens, 0.0, None, lo_open=True)
        self.name = str(name)
        self.layout = ShardLayout.of(params)
        self.params, self.inner_state, self.count = params, inner_state, 0
        self._step_fn, self._transport = train_step, transport
        self._H, self._alpha, self._wait = int(sync_every), float(alpha), bool(wait_for_merge)
        self._timeout, self.max_tokens = reply_timeout_s, None if max_tokens is None else float(max_tokens)
        leaves = jax.tree.leaves(params)
        mesh = leaves[self.layout.leaves[0]].sharding.mesh
        self._devices = list(mesh.devices.flat)
        # Per shard, its anchor pieces: float32 arrays on the shard's device (the global values last received).
        self._anchor = [[jnp.asarray(self._local(leaves[self.layout.leaves[j]], s), jnp.float32) for j, _ in own]
                        for s, own in enumerate(self.layout.owned)]
        self._version = [0] * self.layout.shards
        self._seq = 0
        self._tokens = 0.0
        self._outstanding: dict[int, int] = {}  # shard -> inner step of its send
        self.stats = LearnerStats(bytes_sent=[0], sends=[0], delays=[[]], abandoned=[0], resent=[0])

    def start_from(self, start: Start) -> None:
        """Set every shard's parameters, anchor and version to ``start``'s (:meth:`ShardedSyncer.register`'s:
        one entry per shard), e.g. from ``MultiProcessTransport.join``.

        Raises:
          ValueError: ``start`` does not have this learner's shards and shapes, or a send is in flight.
        """
        if self._outstanding:
            raise ValueError(f"start_from needs no send in flight; shards {sorted(self._outstanding)} await replies")
        if not isinstance(start, Start) or len(start.values) != self.layout.shards or any(
                len(v) != len(a) or any(np.shape(x) != y.shape for x, y in zip(v, a))
                for v, a in zip(start.values, self._anchor)):
            raise ValueError(f"start must be a Start with one entry per shard ({self.layout.shards}) of the shards' "
                             f"shapes, got {start!r:.200}")
        for s, (values, version) in enumerate(zip(start.values, start.versions)):
            self._use(Reply(self.name, 0, int(version), tuple(values), shard=s), mix=False)
        if start.seqs:
            self._seq = max([self._seq, *(int(q) for q in start.seqs)])

    def _local(self, x: jax.Array, s: int) -> jax.Array:
        """Device ``s``'s own array of leaf ``x`` (a single-device array on that device)."""
        d = self._devices[s]
        return next(sh.data for sh in x.addressable_shards if sh.device == d)

    def versions(self) -> list[int]:
        """Per shard, the syncer's version this learner's anchor comes from."""
        return list(self._version)

    def step(self, batch: Any, tokens: float = 1.0) -> Any:
        """One inner step on ``batch``; every ``sync_every`` steps, the outer gradient sent shard by shard."""
        self._apply_replies()
        start = time.perf_counter()
        self.params, self.inner_state, loss = self._step_fn(self.params, self.inner_state, batch)
        jax.block_until_ready(self.params)
        self.stats.step_seconds += time.perf_counter() - start
        self.count += 1
        self._tokens += float(tokens)
        if self.count % self._H == 0:
            while self._outstanding:
                self._await_reply()
            self._send()
        if self._wait:
            while self._outstanding:
                self._await_reply()
        return loss

    def finish(self) -> None:
        """Wait for the replies of the sends in flight (mixed in)."""
        while self._outstanding:
            self._await_reply()

    def _send(self) -> None:
        leaves = jax.tree.leaves(self.params)
        self._seq += 1
        tokens = self._tokens if self.max_tokens is None else min(self._tokens, self.max_tokens)
        S = self.layout.shards
        for s, own in enumerate(self.layout.owned):
            if not own:
                continue
            # On device s, from its own slices only: anchor - θ, raveled and concatenated (the identity's message).
            pieces = [self._anchor[s][k] - self._local(leaves[self.layout.leaves[j]], s).astype(jnp.float32)
                      for k, (j, _) in enumerate(own)]
            buffer = jnp.concatenate([jnp.ravel(x) for x in pieces])
            header = Header(self.name, 0, self._version[s], tokens, self.count, (tuple(buffer.shape),),
                            (np.dtype(buffer.dtype).str,), int(buffer.nbytes), self._seq, shard=s, shards=S)
            self._transport.send(Contribution(header, (buffer,)))
            self.stats.bytes_sent[0] += int(buffer.nbytes)
            self._outstanding[s] = self.count
        self._tokens = 0.0
        self.stats.sends[0] += 1

    def _await_reply(self) -> None:
        start = time.perf_counter()
        reply = self._transport.poll(self.name, timeout=self._timeout)
        self.stats.wait_seconds += time.perf_counter() - start
        if reply is None:
            raise TimeoutError(f"learner {self.name!r}: no reply from the syncer within {self._timeout} s "
                               f"(shards waiting: {sorted(self._outstanding)})")
        self._use(reply)

    def _apply_replies(self) -> None:
        while (reply := self._transport.poll(self.name, timeout=0.0)) is not None:
            self._use(reply)

    def _use(self, reply: Reply, mix: bool = True) -> None:
        s = reply.shard
        sent_at = self._outstanding.pop(s, None) if 0 <= s < self.layout.shards else None
        if not reply.accepted:
            self.stats.refusals.append((reply.fragment, reply.reason))
            logger.warning("learner %r: the syncer refused shard %r: %s", self.name, s, reply.reason)
        if reply.values is None or not 0 <= s < self.layout.shards:
            return
        own = self.layout.owned[s]
        if len(reply.values) != len(own) or any(np.shape(v) != self._anchor[s][k].shape
                                                for k, v in enumerate(reply.values)):
            logger.warning("learner %r: dropped shard %d's reply: its values do not fit the shard", self.name, s)
            return
        if sent_at is not None and not self._outstanding:  # the send's last shard came back
            self.stats.delays[0].append(self.count - sent_at)
        self._anchor[s] = [jax.device_put(np.asarray(v, np.float32), self._devices[s]) for v in reply.values]
        self._version[s] = int(reply.version)
        a = 0.0 if self._wait or not mix else self._alpha
        leaves, treedef = jax.tree.flatten(self.params)
        for k, (j, index) in enumerate(own):
            i = self.layout.leaves[j]
            x = leaves[i]
            value = np.asarray(reply.values[k])
            key = _key(index, x.shape)
            arrays = []
            for sh in x.addressable_shards:  # every device holding this slice takes the merged values
                if _key(sh.index, x.shape) == key:
                    g = jax.device_put(value, sh.device)
                    new = g.astype(x.dtype) if a == 0.0 else (a * sh.data.astype(jnp.float32) + (1 - a) * g
                                                              ).astype(x.dtype)
                    arrays.append(new)
                else:
                    arrays.append(sh.data)
            leaves[i] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)
        self.params = jax.tree.unflatten(treedef, leaves)
