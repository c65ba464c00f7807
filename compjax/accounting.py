"""Bytes on the wire: what the state says was sent, and what the compiled program sends.

``payload_bytes`` reads the counters the compressors keep; ``audit_collectives``
reads the collectives of a compiled program from its HLO, so anyone can check
that the two agree: what a compressor says it sends is what its collectives
carry.  The audit also tells who issued each collective: compjax issues every
one of its collectives inside the named scope ``compjax/...``
(:mod:`compjax.collectives`), which the compiled program keeps in its op
metadata; a model's own collectives (a synchronized BatchNorm, a metrics
``pmean``) and the all-reduces XLA's SPMD partitioner inserts into an
auto-sharded ``jax.jit`` step carry other names.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from compjax import bytecount

__all__ = [
    "COLLECTIVE_OPS",
    "DENSE_GRADIENTS",
    "Collective",
    "audit_collectives",
    "branch_bytes",
    "bytes_by_axes",
    "bytes_by_issuer",
    "collective_axes",
    "format_collectives",
    "message_bytes",
    "payload_bytes",
    "worker_bytes",
]

#: HLO opcodes counted as collectives (async ``-start`` forms included; ``-done`` skipped).
COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)

_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e3m4": 8,
    "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
}
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# The compjax scope as a path segment of an op name, also under JAX's transformation
# wrappers (``transpose(jvp(compjax))/...``).
_COMPJAX_RE = re.compile(r"(?:^|[/(])compjax\)*/")
_UNCOUNTED_RE = re.compile(r"(?:^|[/(])compjax_uncounted\)*/")
# The scope a compressor's update runs under: the bytes of the gradients it was given (compressors.base.grads_scope).
_GRADS_RE = re.compile(r"/grads_(\d+)B\)*/")

#: :attr:`Collective.flag` of a dense floating-point all-reduce that compjax did not issue, as large as the
#: gradients a compressor was given: the gradients crossed the wire densely before (or instead of) compression.
DENSE_GRADIENTS = "dense gradients, not compjax"


def _issuer(scope: str) -> str | None:
    if _UNCOUNTED_RE.search(scope):
        return "compjax-uncounted"
    return "compjax" if _COMPJAX_RE.search(scope) else None


def _array_bytes(dtype: str, shape: tuple) -> int:
    return math.ceil(math.prod(shape) * _DTYPE_BITS[dtype] / 8)


class Collective(NamedTuple):
    """One collective instruction of a compiled program.

    Attributes:
      op: HLO opcode without ``-start`` (e.g. ``"all-reduce"``, ``"all-gather"``).
      operands: ``((dtype, shape), ...)``, one per operand (XLA may combine
        several reductions into one tuple-shaped instruction).
      bytes: total operand bytes: what this device puts into the collective.
      name: the instruction's name in the HLO.
      replica_groups: the groups of devices that take part together, as a tuple
        of tuples of device ids (``((0, 1, 2, 3), (4, 5, 6, 7))``: two groups of
        four), read from the HLO (list or iota form); None where the HLO gives
        none (every device in one group).  On a 2-D mesh this tells which mesh
        axis a collective runs over.
      scopes: the op name each operand carries in the compiled program's
        metadata, one string per entry of ``operands`` (``""`` where the HLO
        gives none): JAX's name stack when the collective was traced, e.g.
        ``"jit(step)/shard_map/compjax/sparse_mean/all_gather"`` for compjax's,
        ``"jit(step)/transpose(jvp(...))/dot_general"`` for an all-reduce XLA's
        SPMD partitioner inserted for a gradient.  Where XLA combined several
        collectives into one instruction, each operand gets the name of the
        collective it came from (read from the combined instruction's
        ``(name:name:...)`` op name or from the ``get-tuple-element`` that
        replaced each original).
      branch: where the collective sits among the program's conditionals
        (``lax.cond``/``lax.switch``, and loops of 0 or 1 trip made under
        :data:`BRANCH_LOOP_SCOPE`, e.g. DiLoCo's sync and no-sync steps): one
        ``(conditional instruction, branch index)`` pair per enclosing
        conditional, outermost first; ``()`` outside any.  A program runs one
        branch of each conditional per step: :func:`worker_bytes` adds the
        bytes of the largest.
      flag: ``""``, or :data:`DENSE_GRADIENTS` for a floating-point all-reduce
        not issued by compjax in a program whose such all-reduces carry at
        least as many bytes as the gradients a compressor of the program was
        given (see :func:`audit_collectives`).
    """

    op: str
    operands: tuple
    bytes: int
    name: str
    replica_groups: tuple | None = None
    scopes: tuple = ()
    flag: str = ""
    branch: tuple = ()

    @property
    def dtype(self) -> str:
        """Operand dtype (HLO spelling, e.g. ``"f32"``); joined with ``,`` if several."""
        return ",".join(d for d, _ in self.operands)

    @property
    def shape(self) -> tuple:
        """Operand shape; a tuple of shapes if the instruction has several operands."""
        if len(self.operands) == 1:
            return self.operands[0][1]
        return tuple(s for _, s in self.operands)

    @property
    def issuers(self) -> tuple:
        """Who issued each operand, one per entry of ``operands``: ``"compjax"`` (its
        scope holds the path segment ``compjax/``: a compressor's payload, issued
        through :mod:`compjax.collectives` and counted by :func:`payload_bytes`),
        ``"compjax-uncounted"`` (issued by compjax's step builders under
        ``compjax_uncounted/``: the dense fast-axis gradient mean of a 2-D mesh,
        model state averaged over workers; no compressor counts it) or None (the
        model, XLA's SPMD partitioner, any other code)."""
        scopes = self.scopes or ("",) * len(self.operands)
        return tuple(_issuer(s) for s in scopes)

    @property
    def issuer(self) -> str | None:
        """The operands' common issuer (``"compjax"``, ``"compjax-uncounted"`` or None),
        or ``"mixed"`` if XLA combined collectives of different issuers into this one."""
        kinds = set(self.issuers)
        if len(kinds) == 1:
            return kinds.pop()
        return "mixed" if kinds else None

    @property
    def by_compjax(self) -> bool:
        """Whether compjax issued every operand of this collective (``issuer == "compjax"``)."""
        return self.issuer == "compjax"

    @property
    def compjax_bytes(self) -> int:
        """Bytes of the operands compjax issued: ``bytes`` for compjax's collectives, 0 for
        the others, the share of compjax's operands in a mixed one."""
        return sum(_array_bytes(d, s) for (d, s), who in zip(self.operands, self.issuers) if who == "compjax")


def _key_name(k) -> str | None:
    for attr in ("name", "key"):
        v = getattr(k, attr, None)
        if isinstance(v, str):
            return v
    return None


def payload_bytes(opt_state: Any) -> np.ndarray:
    """Bytes put into collectives in the last step, summed over every compressor state in ``opt_state``.

    Only what collectives carried counts: a compressor built with
    ``axis_name=None`` sent nothing (one worker; or a ``jax.jit`` step whose
    dense gradients XLA all-reduces), and reads 0 here; the size of the
    message it would send is :func:`message_bytes`.

    Under ``optax.MultiSteps`` the compressor's exchange runs on every
    micro-step (MultiSteps computes the inner update each time and keeps it
    only every ``k``-th): reading the count between two kept steps warns, as
    it repeats the last kept step's count.

    Finds every ``payload_bytes`` counter in the tree: fields of compressor
    states inside any optax state (``optax.chain``, ``inject_hyperparams``,
    ``MultiSteps``, ...), entries of the same name in dicts (a state restored
    from a checkpoint) and in Flax NNX state (``nnx.state(optimizer)``, or the
    ``nnx.Optimizer`` itself).  The counters are exact byte counts held as two
    uint32 words (:mod:`compjax.bytecount`), read on the host.

    **One unit on every layout: bytes per worker over the slow link, in the
    step actually taken.**  On a 2-D mesh (a slow axis between hosts, a fast
    one inside each, :func:`compjax.parallel.make_2d_mesh`) a worker is a
    host: each of its ``fast`` devices sends ``1/fast`` of the count, and the
    result has one entry per host whether the parameters are replicated over
    the fast axis (``fast_axis=``) or sharded (``specs=``).  A step that sent
    nothing (DiLoCo between syncs) reads 0.  :func:`worker_bytes` reads the
    audit of the compiled step in the same unit.

    Args:
      opt_state: an optax state pytree, an NNX ``State`` or NNX object; one
        worker's, or worker-stacked (leading axis of n workers).

    Returns:
      int64 NumPy array: a scalar for one worker's state, shape ``(n,)`` for a
      worker-stacked state (one entry per worker: per host on a 2-D mesh).

    Raises:
      ValueError: an array sharded as replicated whose copies differ across
        devices (worker-local state returned by ``pmap(..., out_axes=None)``,
        :func:`compjax.replicas.check_replicas_agree`); no ``payload_bytes``
        counter was found (e.g. a chain without a compressor, or an object this
        function cannot read).
      TypeError: called on traced values (inside ``jit``): read the state after the step.

    Warns:
      UserWarning: a counter inside an ``optax.MultiSteps`` state read between
        two kept steps (see above).

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> import jax
      >>> tx = optax.chain(cj.topk(0.5, axis_name="w"), optax.sgd(0.1))
      >>> g = {"w": jnp.arange(8.0).reshape(2, 4)}   # two workers' gradients
      >>> step = jax.vmap(tx.update, axis_name="w")
      >>> _, state = step(g, jax.vmap(tx.init)(g))
      >>> cj.payload_bytes(state).tolist()   # per worker: 2 int32 indices + 2 float32 values, and the 4-byte vote
      [20, 20]
    """
    return _sum_counters(opt_state, "payload_bytes", sent_only=True)


def message_bytes(opt_state: Any) -> np.ndarray:
    """Bytes of the messages of the last step, sent or not: :func:`payload_bytes` plus what no collective carried.

    A compressor built with ``axis_name=None`` (one worker; or inside a
    ``jax.jit`` step over replicated parameters and a sharded batch, where XLA
    all-reduces the dense gradients and the compressor sends nothing) counts
    the bytes its message would take if it had a worker axis: that count is
    read here, and reads 0 in :func:`payload_bytes`.  Use it for single-worker
    estimates (compression ratios, the bytes a data-parallel run would send);
    use :func:`payload_bytes` for what crossed the wire.  For compressors with
    a worker axis the two agree.

    Args:
      opt_state: as for :func:`payload_bytes`.

    Returns:
      int64 NumPy array: a scalar for one worker's state, shape ``(n,)`` for a
      worker-stacked state.

    Raises:
      ValueError, TypeError: as :func:`payload_bytes`.

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> tx = optax.chain(cj.topk(0.5), optax.sgd(0.1))   # axis_name=None: one worker, nothing sent
      >>> g = {"w": jnp.arange(4.0)}
      >>> _, state = tx.update(g, tx.init(g))
      >>> int(cj.message_bytes(state)), int(cj.payload_bytes(state))   # 2 int32 indices + 2 float32 values
      (16, 0)
    """
    return _sum_counters(opt_state, "message_bytes", sent_only=False)


def _sum_counters(opt_state: Any, who: str, sent_only: bool) -> np.ndarray:
    from compjax.replicas import check_replicas_agree

    check_replicas_agree(opt_state, who, exact=False)  # worker-local state claimed replicated: refused
    tree = opt_state
    try:
        from flax import nnx

        if isinstance(tree, nnx.Object):
            tree = nnx.state(tree)
    except ImportError:  # pragma: no cover - flax is a dependency
        pass
    _warn_micro_step(tree, who)
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        names = [_key_name(k) for k in path]
        names = [n for n in names if n not in (None, "value", "raw_value")]
        if names and names[-1] == "payload_bytes":
            if isinstance(leaf, jax.core.Tracer):
                raise TypeError(f"{who} reads concrete state: call it outside jit, on the state a step returned")
            count = bytecount.to_int(leaf)
            found.append(_per_worker(leaf, np.where(bytecount.is_sent(leaf), count, 0) if sent_only else count,
                                     "/".join(n for n in names if n)))
    if not found:
        raise ValueError(
            f"no compressor state with a payload_bytes counter found in a {type(opt_state).__name__}: pass the "
            "optimizer state of a chain that holds a compjax compressor (or nnx.state of an nnx.Optimizer)"
        )
    return np.asarray(sum(found[1:], found[0]), np.int64)


def _per_worker(leaf: Any, count: np.ndarray, where: str) -> np.ndarray:
    """One entry per worker: a counter stacked over several mesh axes keeps each worker's first device's.

    In the replicated 2-D layout (``replicate(..., fast_axis=...)``) the
    leading axis runs over ``(slow, fast)``: every device of a host holds the
    host's count.  The entries of one worker must agree (a ValueError otherwise).
    """
    spec = getattr(getattr(leaf, "sharding", None), "spec", None)
    if not spec or np.ndim(count) < 1 or not isinstance(spec[0], tuple) or len(spec[0]) < 2:
        return count
    workers = leaf.sharding.mesh.shape[spec[0][0]]
    grouped = np.asarray(count).reshape(workers, -1, *np.shape(count)[1:])
    if not (grouped == grouped[:, :1]).all():
        raise ValueError(f"the devices of one worker hold different byte counts in {where}: {grouped.tolist()}")
    return grouped[:, 0]


def _has_counter(tree: Any) -> bool:
    return any(_key_name(path[-1]) == "payload_bytes" for path, _ in jax.tree_util.tree_leaves_with_path(tree) if path)


def _warn_micro_step(tree: Any, who: str) -> None:
    """Warn when a compressor's counter is read inside an ``optax.MultiSteps`` state between two kept steps.

    ``optax.MultiSteps`` runs its inner transformation -- a compressor's
    exchange included -- on every micro-step and keeps the new inner state only
    every ``k``-th: the wire carries the payload on every micro-step while the
    state keeps the count of the last kept step.  The message names the fix,
    :func:`compjax.multi_steps`.
    """
    import optax

    nodes = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, optax.MultiStepsState))
             if isinstance(x, optax.MultiStepsState)]
    for node in nodes:
        if isinstance(node.mini_step, jax.core.Tracer) or not _has_counter(node.inner_opt_state):
            continue
        if np.any(np.asarray(node.mini_step) != 0):
            warnings.warn(
                f"{who}: this state is between two kept steps of optax.MultiSteps (mini_step != 0). MultiSteps runs "
                "the compressor's exchange on every micro-step and keeps its result only every k-th step, so the "
                "wire carried a payload on this step too, while the count read here is that of the last kept step "
                "(0 before the first). To exchange once per k micro-batches, replace optax.MultiSteps(inner, k) "
                "with cj.multi_steps(inner, k) (the same accumulation; the exchange runs only on the k-th step and "
                "the count reads 0 on micro-steps), or accumulate the micro-batches' gradients inside the step "
                "(one compressor update per step)", stacklevel=3)
            return


def _split_top(s: str) -> list[str]:
    """Split ``s`` at top-level commas (outside (), [], {})."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _matching(s: str, start: int) -> int:
    """Index of the bracket closing the one at ``s[start]``."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] in "([{":
            depth += 1
        elif s[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in HLO line: {s[:200]}")


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (d, tuple(int(x) for x in dims.split(",") if x))
        for d, dims in _ARRAY_RE.findall(type_text)
        if d in _DTYPE_BITS
    ]


def _parse_hlo(text: str):
    """Yield ``(name, type_text, opcode, operand_texts, attribute_text)`` for each instruction line."""
    for line in text.splitlines():
        line = line.strip()
        line = line.removeprefix("ROOT ")
        m = re.match(r"%?([\w.\-]+)\s*=\s*", line)
        if not m:
            continue
        rest = line[m.end():]
        if rest.startswith("("):
            end = _matching(rest, 0)
            type_text, rest = rest[: end + 1], rest[end + 1:].lstrip()
        else:
            sp = rest.find(" ")
            if sp < 0:
                continue
            type_text, rest = rest[:sp], rest[sp + 1:].lstrip()
        om = re.match(r"([\w\-]+)\(", rest)
        if not om:
            continue
        paren = om.end() - 1
        close = _matching(rest, paren)
        yield m.group(1), type_text, om.group(1), _split_top(rest[paren + 1: close]), rest[close + 1:]


def _nbytes(arrays) -> int:
    return sum(math.ceil(math.prod(s) * _DTYPE_BITS[d] / 8) for d, s in arrays)


def audit_collectives(fn: Callable, *args, **kwargs) -> list[Collective]:
    """List the collectives of the compiled program of ``fn(*args, **kwargs)``.

    The function is lowered and compiled (``jax.jit`` is applied if ``fn`` is not
    already jitted) and the optimized HLO text is read: every instruction whose
    opcode is in :data:`COLLECTIVE_OPS` (or its async ``-start`` form) is
    returned with its operands' dtypes and shapes, looked up from the
    instructions that define them.  Under ``shard_map`` or ``pmap`` the program
    is the per-device one, so ``bytes`` is what one worker puts into each
    collective.  Note that ``jax.vmap(..., axis_name=...)`` compiles collectives
    away: audit under ``shard_map`` or ``pmap``.

    **Who issued it.**  Each collective's ``scopes`` holds the op name its
    operands carry in the compiled program's metadata, and ``issuer`` says
    whether compjax issued it: every collective compjax issues goes through
    :mod:`compjax.collectives`, inside the named scope ``compjax/<what>``
    (``vote``, ``dense_mean``, ``sparse_mean``, ``gathered_mean``, ``max``).  A
    model's own collectives (a synchronized BatchNorm, a metrics ``pmean``) and
    the gradient all-reduce XLA's SPMD partitioner inserts into a ``jax.jit``
    step over replicated parameters and a sharded batch (no ``shard_map``: a
    compressor with ``axis_name=None`` then sends nothing and the gradients
    travel densely) read ``issuer=None``.  :func:`bytes_by_issuer` splits the
    bytes, :func:`format_collectives` prints the table.  With jaxlib 0.10.2 on
    CPU the scope survives into the compiled program, also inside ``lax.cond``
    branches and loops and when XLA's all-reduce combiner merges collectives
    (compjax's with a model's, too: ``issuer="mixed"``, each operand keeps its
    own scope); where a combiner drops the merged op name, each operand's is read
    from the ``get-tuple-element`` that replaced the original collective (after
    the ``-done`` of an async collective).  compjax's other collectives, which no
    compressor counts: the fast-axis mean of
    :func:`compjax.parallel.data_parallel_step` on a 2-D mesh and model state averaged over workers by
    :func:`compjax.parallel.worker_step` (``average=``): both run under the
    scope ``compjax_uncounted/`` and read ``issuer="compjax-uncounted"``.

    **Dense gradients that compjax did not send.**  Every compressor runs
    under a named scope holding the bytes of the gradients it was given
    (``.../cj.topk/grads_23024B/...``).  When the floating-point all-reduces
    not issued by compjax carry together at least that many bytes, each gets
    ``flag ==`` :data:`DENSE_GRADIENTS` and a ``UserWarning`` names the fix:
    the gradients crossed the wire densely -- a leftover
    ``lax.pmean(grads)`` of a pmap program (under ``pmap`` no type says it;
    under ``jax.shard_map`` the compressor refuses such gradients at trace
    time), or the dense all-reduce XLA inserts into a ``jax.jit`` step over
    replicated parameters.  A model's own small collectives (a BatchNorm's
    statistics) are not flagged, nor all-reduces that stay inside a worker
    (XLA partitioning each worker's step over ``fsdp`` / ``tensor``: no group
    of theirs holds two devices that meet in a group of compjax's collectives,
    which run over the worker axis; those XLA's partitioner inserts inside
    compjax's scope to lay its values out over a worker's devices do not tell
    workers apart and are left out).

    **Bytes.**  The bytes are those of the compiled operands, which can differ
    from the traced dtype: XLA:CPU reduces bfloat16 as float32 and float8 as
    float16 (twice the bytes; :func:`compjax.collectives.reduce_bytes` counts
    them so) and would widen all-gathers the same way, which is why compjax
    sends narrow floats through all-gathers bitcast to unsigned integers.  For
    every compressor, ``payload_bytes`` equals the audited compjax bytes of one
    step for float32, bfloat16 and float16 leaves (checked on CPU; other
    backends are taken to reduce 16-bit floats natively).

    Args:
      fn: a function or a ``jax.jit``-wrapped function, or a program already
        compiled (``jitted.lower(...).compile()``, then no arguments): the
        audit then reads the very program that runs.
      *args: example positional arguments of ``fn`` (arrays or ``jax.ShapeDtypeStruct``).
      **kwargs: example keyword arguments of ``fn``, the same kinds.

    Returns:
      A list of :class:`Collective`, in program order.

    Warns:
      UserWarning: dense floating-point all-reduces not issued by compjax as
        large as the gradients a compressor was given (flagged
        :data:`DENSE_GRADIENTS`).

    Raises:
      ValueError: example arguments given with a compiled program.

    Examples:
      A data-parallel step with top-k on every device: per worker, one 4-byte
      vote, then 100 int32 indices and 100 float32 values, which is what the
      compressor's ``payload_bytes`` says it sent.

      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> from compjax import parallel
      >>> mesh = parallel.make_mesh()  # every device is a worker
      >>> tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.sgd(0.1))
      >>> params = {"w": jnp.zeros((20, 50))}
      >>> loss = lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2)
      >>> step = parallel.data_parallel_step(loss, tx, mesh)
      >>> p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
      >>> x = parallel.shard_batch(jnp.ones((4 * mesh.size, 20)), mesh)
      >>> ops = audit_collectives(step, p, s, x)
      >>> sorted((op.op, op.dtype, op.bytes) for op in ops)
      [('all-gather', 'f32', 400), ('all-gather', 's32', 400), ('all-reduce', 's32', 4)]
      >>> sorted({op.issuer for op in ops}), bytes_by_issuer(ops)
      (['compjax'], {'compjax': 804, 'compjax-uncounted': 0, 'other': 0})
      >>> p, s, loss_per_worker = step(p, s, x)
      >>> int(cj.payload_bytes(s)[0]) == sum(op.bytes for op in ops)
      True
    """
    if isinstance(fn, jax.stages.Compiled):
        if args or kwargs:
            raise ValueError("a compiled program takes no example arguments: audit_collectives(compiled)")
        text = fn.as_text()
    else:
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        text = jitted.lower(*args, **kwargs).compile().as_text()
    ops = _collectives_of_hlo(text)
    workers = getattr(fn, "worker_of_device", None)  # compjax.parallel.worker_step's: each device's worker
    if workers is not None:
        ops = _flag_dense_gradients([op._replace(flag="") for op in ops], _grads_bytes(text), tuple(workers))
    flagged = [op for op in ops if op.flag == DENSE_GRADIENTS]
    if flagged:
        warnings.warn(_dense_gradients_message(flagged, _grads_bytes(text)), stacklevel=2)
    return ops


def _grads_bytes(text: str) -> int:
    """The largest gradient size (bytes per device) a compressor of the program was given, 0 if none says."""
    return max((int(n) for n in _GRADS_RE.findall(text)), default=0)


def _dense_float_others(op: Collective) -> int:
    """Bytes of ``op``'s floating-point operands that compjax did not issue, if ``op`` is an all-reduce."""
    if op.op != "all-reduce":
        return 0
    return sum(_array_bytes(d, s) for (d, s), who in zip(op.operands, op.issuers)
               if who is None and d.startswith(("f", "bf")))


#: The last op-name segment of a collective JAX traced (``.../compjax/dense_mean/psum``): what compjax's own
#: collectives over the worker axis are named in the compiled program.  A collective XLA's partitioner inserts
#: inside compjax's scope, to lay out compjax's values over a worker's devices, carries the name of the op it
#: partitions instead (``.../compjax/gathered_mean/shard_map``, ``.../reshape``).
_JAX_COLLECTIVES = frozenset({
    "psum", "pmax", "pmin", "psum_invariant", "unreduced_psum", "all_gather", "all_gather_invariant",
    "all_gather_reduced", "all_to_all", "ragged_all_to_all", "ppermute", "pbroadcast", "reduce_scatter",
    "unreduced_reduce_scatter"})


def _traced_collective(scope: str) -> bool:
    """Whether ``scope`` (one operand's op name) names a collective JAX traced, not one XLA inserted."""
    return scope.rstrip(")").rsplit("/", 1)[-1] in _JAX_COLLECTIVES


def _worker_pairs(ops: list[Collective]) -> set | None:
    """Pairs of devices of different workers: two devices that meet in a group of a collective compjax issued
    (compjax's collectives run over the worker axis).  Only collectives JAX traced count (every operand's op
    name ends in a collective's name): those XLA's partitioner inserts inside compjax's scope run inside a
    worker.  None when no such collective says its groups."""
    pairs: set = set()
    for op in ops:
        if op.issuer != "compjax" or op.op == "collective-permute" or not op.replica_groups:
            continue
        if not all(_traced_collective(s) for s in op.scopes):
            continue
        for g in op.replica_groups:
            pairs.update((a, b) for a in g for b in g if a != b)
    return pairs or None


def _crosses_workers(op: Collective, pairs: set | None, workers: tuple | None = None) -> bool:
    """Whether ``op`` reaches between workers: some group of it holds two devices of different workers, told
    apart by ``workers`` (each device's worker) or else by ``pairs`` (all collectives count as crossing when
    neither tells them apart)."""
    if not op.replica_groups:
        return True
    if workers is not None:
        return any(len({workers[d] if d < len(workers) else -1 - d for d in g}) > 1 for g in op.replica_groups)
    if pairs is None:
        return True
    return any((a, b) in pairs for g in op.replica_groups for a in g for b in g if a != b)


def _flag_dense_gradients(ops: list[Collective], grads: int, workers: tuple | None = None) -> list[Collective]:
    """``ops`` with :data:`DENSE_GRADIENTS` on the float all-reduces of others that reach between workers, when
    together they carry ``>= grads`` bytes.

    All-reduces that stay inside a worker (XLA partitioning a worker's step over the mesh's other axes:
    ``fsdp``, ``tensor``) never cross the worker axis and are not counted; a worker's devices are told apart
    from other workers' by ``workers`` (each device's worker, given by the step), else by the groups of
    compjax's own collectives (:func:`_worker_pairs`; where compjax also reduces inside a worker, every
    all-reduce then counts).
    """
    pairs = _worker_pairs(ops) if workers is None else None
    crossing = [_dense_float_others(op) if _crosses_workers(op, pairs, workers) else 0 for op in ops]
    if not grads or sum(crossing) < grads:
        return ops
    return [op._replace(flag=DENSE_GRADIENTS) if c else op for op, c in zip(ops, crossing)]


def _dense_gradients_message(flagged: list[Collective], grads: int) -> str:
    total = sum(_dense_float_others(op) for op in flagged)
    return (
        f"audit_collectives: {len(flagged)} floating-point all-reduce(s) not issued by compjax carry {total:,} B per "
        f"device, at least the {grads:,} B of gradients a compressor of this step was given: the gradients crossed "
        f"the wire densely, not compressed. Either the step averages the gradients itself (a leftover "
        f"`grads = jax.lax.pmean(grads, axis)` from a pmap program: remove it, compjax averages them), or it is a "
        f"jax.jit step over replicated parameters and a sharded batch, where XLA all-reduces the gradients and the "
        f"compressor (axis_name=None) sends nothing: run the step with a worker axis "
        f"(compjax.parallel.worker_step or data_parallel_step, compressors built with that axis_name). "
        f"Flagged: {', '.join(op.name for op in flagged)} (Collective.flag == {DENSE_GRADIENTS!r})"
    )


_OP_NAME_RE = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')


def _operand_name(text: str) -> str:
    """The instruction an operand refers to: ``%x``, ``x`` or ``f32[10]{0} %x`` -> ``x``."""
    return text.split()[-1].lstrip("%") if text.strip() else ""


def _split_combined(op_name: str, n: int) -> list[str] | None:
    """The ``n`` op names of a combined collective's ``prefix/(a:b:...)`` op name, or None.

    XLA's all-reduce combiner (jaxlib 0.10.2) names the instruction it makes
    from ``n`` collectives ``<common prefix>(<rest 1>:<rest 2>:...)``, one part
    per operand in operand order.
    """
    if n < 2 or not op_name.endswith(")"):
        return None
    depth = 0
    for start in range(len(op_name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(op_name[start], 0)
        if depth == 0:
            break
    if depth or (start > 0 and op_name[start - 1] != "/"):  # unbalanced, or "jit(f)": a name, not a group
        return None
    parts, depth, cur = [], 0, []
    for ch in op_name[start + 1: -1]:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ":" and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [op_name[:start] + p for p in parts] if len(parts) == n else None


def _collectives_of_hlo(text: str) -> list[Collective]:
    """The collectives of an optimized HLO module's text (see :func:`audit_collectives`)."""
    types: dict[str, str] = {}
    found = []
    dones: dict[str, str] = {}  # start instruction -> its -done
    gtes: dict[tuple[str, int], str] = {}  # (tuple instruction, index) -> op name of the get-tuple-element
    for name, type_text, opcode, operands, attrs in _parse_hlo(text):
        types[name] = type_text
        op_name = m.group(1) if (m := _OP_NAME_RE.search(attrs)) else ""
        if opcode.endswith("-done") and operands:
            dones[_operand_name(operands[0])] = name
        elif opcode == "get-tuple-element" and operands and op_name and (im := re.search(r"\bindex=(\d+)", attrs)):
            gtes[(_operand_name(operands[0]), int(im.group(1)))] = op_name
        op = opcode.removesuffix("-start")
        if op in COLLECTIVE_OPS:
            found.append((name, op, operands, _replica_groups(attrs), op_name))
    out = []
    for name, op, operands, groups, op_name in found:
        per_operand = []
        for o in operands:
            if o.startswith("%") or re.match(r"^[\w.\-]+$", o):
                per_operand.append(_arrays(types.get(o.lstrip("%"), "")))
            else:  # operand printed with its type, e.g. "f32[10]{0} %x"
                per_operand.append(_arrays(o.split("%")[0]))
        names = _operand_scopes(name, op_name, len(operands), dones, gtes)
        arrays = [a for part in per_operand for a in part]
        scopes = tuple(s for part, s in zip(per_operand, names) for _ in part)
        out.append(Collective(op, tuple(arrays), _nbytes(arrays), name, groups, scopes))
    branches = _branches_of_hlo(text)
    out = [o._replace(branch=branches.get(o.name, ())) for o in out]
    return _flag_dense_gradients(out, _grads_bytes(text))


#: Name scope of a loop that runs 0 or 1 times on a runtime condition (:func:`compjax.diloco`'s synchronizations,
#: a ``lax.cond`` that updates its state in place): the audit takes its body as the one branch of a conditional.
BRANCH_LOOP_SCOPE = "compjax_branch_loop"
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_CALLS_RE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")


def _branches_of_hlo(text: str) -> dict[str, tuple]:
    """For each instruction of an HLO module's text, the conditionals' branches that enclose it.

    Returns ``{instruction name: ((conditional name, branch index), ...)}``,
    outermost first (``()`` outside any conditional).  Branches are read from
    ``branch_computations={%a, %b}`` (``lax.switch``, and ``lax.cond`` with
    an integer index) and ``true_computation=``/``false_computation=`` (a
    boolean predicate: branch 0 is the true one); the body of a loop made
    under the name scope :data:`BRANCH_LOOP_SCOPE` (0 or 1 trip) is branch 0
    of that loop; a computation called from
    another (fusions, loops, reductions) inherits its caller's branches.
    """
    where: dict[str, str] = {}  # instruction -> its computation
    parent: dict[str, tuple[str, tuple]] = {}  # computation -> (calling computation, branch label or ())
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if (m := _COMPUTATION_RE.match(line)) and "=" not in line.split("(")[0]:
            current = m.group(1)
            continue
        if current is None or not (im := re.match(r"(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)):
            continue
        name = im.group(1)
        where[name] = current
        if (bm := re.search(r"branch_computations=\{([^}]*)\}", line)):
            for i, c in enumerate(re.findall(r"%?([\w.\-]+)", bm.group(1))):
                parent.setdefault(c, (current, ((name, i),)))
        if (wm := re.search(r"\bbody=%?([\w.\-]+)", line)) and f"/{BRANCH_LOOP_SCOPE}/" in line:
            parent.setdefault(wm.group(1), (current, ((name, 0),)))  # a loop of 0 or 1 trip: a branch
        for kind, index in (("true_computation", 0), ("false_computation", 1)):
            if (tm := re.search(rf"\b{kind}=%?([\w.\-]+)", line)):
                parent.setdefault(tm.group(1), (current, ((name, index),)))
        for c in _CALLS_RE.findall(line):
            parent.setdefault(c, (current, ()))

    def path(comp: str, seen: frozenset = frozenset()) -> tuple:
        if comp not in parent or comp in seen:
            return ()
        caller, label = parent[comp]
        return path(caller, seen | {comp}) + label

    memo: dict[str, tuple] = {}
    return {name: memo.setdefault(comp, path(comp)) for name, comp in where.items()}


def _operand_scopes(name: str, op_name: str, n: int, dones: dict, gtes: dict) -> list[str]:
    """The op name of each of a collective's ``n`` operands.

    A collective with one operand carries its own.  For several (XLA combined
    collectives into one instruction, or one JAX collective over several
    arrays), operand ``i`` takes the op name of the ``get-tuple-element`` of
    index ``i`` of the result (of the ``-done`` for an async collective): the
    instruction that replaced the original collective keeps its metadata, in
    XLA versions whose combiners drop or merge the combined op name too; then
    part ``i`` of a combined ``prefix/(a:b:...)`` op name; then the
    instruction's own op name.
    """
    if n == 1:
        return [op_name]
    result = dones.get(name, name)
    parts = _split_combined(op_name, n) or [op_name] * n
    return [gtes.get((result, i)) or parts[i] for i in range(n)]


def _replica_groups(attrs: str) -> tuple | None:
    """``replica_groups`` of an HLO instruction's attribute text, as a tuple of tuples of ids.

    Reads the list form ``{{0,1},{2,3}}``, the iota form ``[G,S]<=[d0,d1,...]``
    (optionally ``T(perm)``): ``arange(prod(d)).reshape(d).transpose(perm).reshape(G, S)``,
    the mesh form ``mesh['a'=2,'b'=4] {'a'}`` (groups along the named axes, ids
    row-major in the mesh) and a collective-permute's ``source_target_pairs``
    (each pair a group of two).
    """
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        dims = [int(d) for _, d in names]
        over = {a.strip().strip("'") for a in m.group(2).split(",") if a.strip()}
        moved = [i for i, (a, _) in enumerate(names) if a in over]
        kept = [i for i in range(len(dims)) if i not in moved]
        ids = np.arange(math.prod(dims)).reshape(dims).transpose(kept + moved)
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(-1, math.prod(dims[i] for i in moved)))
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:
        return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))) or None
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        groups = tuple(tuple(int(v) for v in g.split(",") if v.strip())
                       for g in re.findall(r"\{([\d,\s]*)\}", m.group(1)))
        return groups or None
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = [int(v) for v in m.group(1).split(",")]
        dims = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(shape[0], -1))
    return None


def bytes_by_issuer(ops: list[Collective]) -> dict[str, int]:
    """Split the audited bytes into what compjax sent and what others sent.

    Args:
      ops: the output of :func:`audit_collectives`.

    Returns:
      ``{"compjax": bytes, "compjax-uncounted": bytes, "other": bytes}``:
      operand bytes of the compressors' collectives (what :func:`payload_bytes`
      counts), of compjax's uncounted ones (fast-axis gradient mean, model state
      averaged by the step builders) and of every other collective (the
      model's, XLA's SPMD partitioner's), per device.  Operands of a mixed
      collective go to their own issuer.

    Examples:
      >>> ops = [Collective("all-reduce", (("s32", ()),), 4, "pmax", None, ("jit(f)/compjax/vote/pmax",)),
      ...        Collective("all-reduce", (("f32", (10,)),), 40, "ar", None, ("jit(f)/transpose(jvp(dot))",))]
      >>> bytes_by_issuer(ops)
      {'compjax': 4, 'compjax-uncounted': 0, 'other': 40}
    """
    out = {"compjax": 0, "compjax-uncounted": 0, "other": 0}
    for op in ops:
        for (d, shape), who in zip(op.operands, op.issuers):
            out[who or "other"] += _array_bytes(d, shape)
    return out


def collective_axes(op: Collective, mesh: Any) -> tuple[str, ...]:
    """The mesh axes a collective runs over, read from its replica groups.

    A device's id in the compiled program's replica groups is its position in
    ``mesh.devices`` (row-major); the axes are those along which the members of
    a group differ.  On a ``slow x fast`` mesh (``compjax.parallel.make_2d_mesh``)
    ``("data",)`` is the slow link between hosts and ``("fast",)`` the link
    inside a host.

    Args:
      op: one entry of :func:`audit_collectives`.
      mesh: the ``jax.sharding.Mesh`` the program was compiled for.

    Returns:
      The axis names, in the mesh's order (all of them when the HLO gives no groups).

    Examples:
      >>> import jax
      >>> from compjax import parallel
      >>> mesh = parallel.make_2d_mesh(2, 4)
      >>> collective_axes(Collective("all-gather", (("u32", (8,)),), 32, "ag", ((0, 4), (1, 5), (2, 6), (3, 7))), mesh)
      ('data',)
    """
    shape = mesh.devices.shape
    groups = op.replica_groups or (tuple(range(int(np.prod(shape)))),)
    varied = set()
    for g in groups:
        coords = np.array([np.unravel_index(i, shape) for i in g])
        varied |= {a for a in range(len(shape)) if len(set(coords[:, a])) > 1}
    return tuple(name for a, name in enumerate(mesh.axis_names) if a in varied)


def bytes_by_axes(ops: list[Collective], mesh: Any, issuer: str | None = "compjax") -> dict[tuple, int]:
    """Audited bytes per device, by the mesh axes the collectives run over.

    On a ``slow x fast`` mesh the compressors' payload crosses the slow link
    split over the host's devices, each sending ``1/fast`` of it: the slow-axis
    entry times ``fast`` is the host's payload, what :func:`payload_bytes`
    reports per worker.

    Args:
      ops: the output of :func:`audit_collectives`.
      mesh: the mesh the program was compiled for.
      issuer: count only operands of this issuer (``"compjax"``,
        ``"compjax-uncounted"``; ``"other"`` for the model's and XLA's), or
        None for all.

    Returns:
      ``{axes: bytes}``, e.g. ``{("data",): 116, ("fast",): 2004}``.
    """
    out: dict[tuple, int] = {}
    for op in ops:
        axes = collective_axes(op, mesh)
        for (d, shape), who in zip(op.operands, op.issuers):
            if issuer is None or (who or "other") == issuer:
                out[axes] = out.get(axes, 0) + _array_bytes(d, shape)
    return out


def worker_bytes(ops: list[Collective], mesh: Any = None, axis_name: str = "data",
                 issuer: str | None = "compjax") -> int:
    """Audited bytes per worker over the worker axis in one step: the unit of :func:`payload_bytes`.

    The audit is per device (each device's operands); :func:`payload_bytes`
    is per worker (a slow-axis replica: a host on a ``slow x fast`` mesh) over
    the slow link.  This puts the audit in that unit: the operand bytes of the
    collectives that run over ``axis_name``, times the devices of one worker
    (``fast``; 1 on a 1-D mesh), each of which sends its part.  Collectives
    inside conditionals (``lax.cond``, or a loop of 0 or 1 trip under
    :data:`BRANCH_LOOP_SCOPE`: DiLoCo's sync and no-sync steps,
    delayed averaging's exchange) count the largest branch of each, so the
    result is that of a step that sends; on a step that sends nothing,
    ``payload_bytes`` reads 0.

    Args:
      ops: the output of :func:`audit_collectives`.
      mesh: the mesh the program was compiled for, or None (a 1-D mesh or
        ``pmap``: every collective runs over the worker axis, one device per worker).
      axis_name: the worker (slow) axis.
      issuer: count only operands of this issuer (``"compjax"``: what
        :func:`payload_bytes` counts), or None for all.

    Returns:
      Bytes per worker, an int.

    Raises:
      ValueError: ``axis_name`` not an axis of ``mesh``.

    Examples:
      >>> ops = [Collective("all-gather", (("u32", (4,)),), 16, "ag", ((0, 4), (1, 5), (2, 6), (3, 7)),
      ...                   ("jit(f)/compjax/gathered_mean/all_gather",))]
      >>> from compjax import parallel
      >>> worker_bytes(ops, parallel.make_2d_mesh(2, 4))   # each of a host's 4 devices sends 16 bytes
      64
    """
    counts = _worker_counts(ops, mesh, axis_name, issuer)

    def total(prefix: tuple) -> int:
        here = sum(n for branch, n in counts if branch == prefix)
        nested: dict[str, dict[int, None]] = {}
        for branch, _ in counts:
            if len(branch) > len(prefix) and branch[: len(prefix)] == prefix:
                cond, idx = branch[len(prefix)]
                nested.setdefault(cond, {})[idx] = None
        return here + sum(max(total(prefix + ((cond, i),)) for i in idxs) for cond, idxs in nested.items())

    return total(())


def branch_bytes(ops: list[Collective], mesh: Any = None, axis_name: str = "data",
                 issuer: str | None = "compjax") -> dict[tuple, int]:
    """Audited bytes per worker over the worker axis, by the conditional branch the collectives sit in.

    :func:`worker_bytes` adds the largest branch of every conditional: for a
    program whose conditionals fire on different steps (Streaming DiLoCo: one
    conditional per fragment, each on its own schedule) that is more than any
    one step sends.  Here each branch is apart, so a step's
    :func:`payload_bytes` can be matched to the branches it took: the
    unconditional bytes (key ``()``) plus those of the branches that ran.

    Args:
      ops, mesh, axis_name, issuer: as for :func:`worker_bytes`.

    Returns:
      ``{branch: bytes per worker}``, ``branch`` as :attr:`Collective.branch`
      (``()`` for collectives outside any conditional); branches without a
      counted collective are left out.

    Raises:
      ValueError: ``axis_name`` not an axis of ``mesh``.
    """
    out: dict[tuple, int] = {}
    for branch, n in _worker_counts(ops, mesh, axis_name, issuer):
        if n:
            out[branch] = out.get(branch, 0) + n
    return out


def _worker_counts(ops, mesh, axis_name, issuer) -> list[tuple[tuple, int]]:
    """``(branch, bytes per worker over axis_name)`` for each collective (see :func:`worker_bytes`)."""
    per_worker = 1
    if mesh is not None:
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
        per_worker = mesh.size // mesh.shape[axis_name]
    out = []
    for op in ops:
        crosses = mesh is None or axis_name in collective_axes(op, mesh)
        n = sum(_array_bytes(d, shape) for (d, shape), who in zip(op.operands, op.issuers)
                if issuer is None or (who or "other") == issuer) if crosses else 0
        out.append((op.branch, n * per_worker))
    return out


def format_collectives(ops: list[Collective]) -> str:
    """A readable table of audited collectives: one line each, then the bytes by issuer.

    Each line gives the opcode, the operands (HLO dtype and shape), the bytes
    this device puts in, the issuer (``compjax``, ``not compjax`` or ``mixed``)
    and the op name of the first operand, then ``[<flag>]`` for a flagged one
    (:data:`DENSE_GRADIENTS`).  The last line adds up the bytes
    issued by compjax and by others, and lists the other collectives' opcodes:
    an auto-sharded ``jax.jit`` step whose compressor has no worker axis reads
    ``not issued by compjax: ... all-reduce``: the dense gradient all-reduce XLA
    inserted, while compjax sent nothing.

    Args:
      ops: the output of :func:`audit_collectives`.

    Returns:
      A string of ``len(ops) + 1`` lines.

    Examples:
      >>> ops = [Collective("all-reduce", (("s32", ()),), 4, "pmax", None, ("jit(f)/compjax/vote/pmax",)),
      ...        Collective("all-reduce", (("f32", (10,)),), 40, "ar", None, ("jit(f)/transpose(jvp(dot))",))]
      >>> print(format_collectives(ops))
      all-reduce  s32[]     4 B  compjax      jit(f)/compjax/vote/pmax
      all-reduce  f32[10]  40 B  not compjax  jit(f)/transpose(jvp(dot))
      compjax: 4 B in 1 collective; not issued by compjax: 40 B in 1 collective (all-reduce)
    """
    label = {"compjax": "compjax", "compjax-uncounted": "compjax, uncounted", "mixed": "mixed", None: "not compjax"}
    rows = [
        (op.op, ",".join(f"{d}[{','.join(map(str, s))}]" for d, s in op.operands), f"{op.bytes:,} B",
         label[op.issuer], (op.scopes or ("",))[0])
        for op in ops
    ]
    widths = [max([len(r[i]) for r in rows] or [0]) for i in range(4)]
    lines = ["  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3].ljust(widths[3]),
                        r[4]]).rstrip() + (f"  [{op.flag}]" if op.flag else "") for r, op in zip(rows, ops)]
    split = bytes_by_issuer(ops)
    ours = [op for op in ops if "compjax" in op.issuers]
    others = [op for op in ops if None in op.issuers]
    plural = lambda k: f"{k} collective" + ("" if k == 1 else "s")
    kinds = sorted({op.op for op in others})
    uncounted = [op for op in ops if "compjax-uncounted" in op.issuers]
    lines.append(f"compjax: {split['compjax']:,} B in {plural(len(ours))}; "
                 + (f"compjax, not in payload_bytes: {split['compjax-uncounted']:,} B in {plural(len(uncounted))}; "
                    if uncounted else "")
                 + f"not issued by compjax: {split['other']:,} B in {plural(len(others))}"
                 + (f" ({', '.join(kinds)})" if kinds else ""))
    return "\n".join(lines)
