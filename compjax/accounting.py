"""Bytes on the wire: what the state says was sent, and what the compiled program sends.

``payload_bytes`` reads the counters the compressors keep; ``audit_collectives``
reads the collectives of a compiled program from its HLO, so anyone can check
that the two agree: what a compressor says it sends is what its collectives
carry.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from compjax import bytecount

__all__ = ["COLLECTIVE_OPS", "Collective", "audit_collectives", "payload_bytes"]

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
    """

    op: str
    operands: tuple
    bytes: int
    name: str
    replica_groups: tuple | None = None

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


def _key_name(k) -> str | None:
    for attr in ("name", "key"):
        v = getattr(k, attr, None)
        if isinstance(v, str):
            return v
    return None


def payload_bytes(opt_state: Any) -> np.ndarray:
    """Bytes put into collectives in the last step, summed over every compressor state in ``opt_state``.

    Finds every ``payload_bytes`` counter in the tree: fields of compressor
    states inside any optax state (``optax.chain``, ``inject_hyperparams``,
    ``MultiSteps``, ...), entries of the same name in dicts (a state restored
    from a checkpoint) and in Flax NNX state (``nnx.state(optimizer)``, or the
    ``nnx.Optimizer`` itself).  The counters are exact byte counts held as two
    uint32 words (:mod:`compjax.bytecount`), read on the host.

    Args:
      opt_state: an optax state pytree, an NNX ``State`` or NNX object; one
        worker's, or worker-stacked (leading axis of n workers).

    Returns:
      int64 NumPy array: a scalar for one worker's state, shape ``(n,)`` for a
      worker-stacked state (one entry per worker).

    Raises:
      ValueError: an array sharded as replicated whose copies differ across
        devices (worker-local state returned by ``pmap(..., out_axes=None)``,
        :func:`compjax.replicas.check_replicas_agree`); no ``payload_bytes``
        counter was found (e.g. a chain without a compressor, or an object this
        function cannot read).
      TypeError: called on traced values (inside ``jit``): read the state after the step.

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> tx = optax.chain(cj.topk(0.5), optax.sgd(0.1))
      >>> g = {"w": jnp.arange(4.0)}
      >>> _, state = tx.update(g, tx.init(g))
      >>> int(cj.payload_bytes(state))   # 2 int32 indices + 2 float32 values
      16
    """
    from compjax.replicas import check_replicas_agree

    check_replicas_agree(opt_state, "payload_bytes", exact=False)  # worker-local state claimed replicated: refused
    tree = opt_state
    try:
        from flax import nnx

        if isinstance(tree, nnx.Object):
            tree = nnx.state(tree)
    except ImportError:  # pragma: no cover - flax is a dependency
        pass
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        names = [_key_name(k) for k in path]
        names = [n for n in names if n not in (None, "value", "raw_value")]
        if names and names[-1] == "payload_bytes":
            if isinstance(leaf, jax.core.Tracer):
                raise TypeError("payload_bytes reads concrete state: call it outside jit, on the state a step returned")
            found.append(bytecount.to_int(leaf))
    if not found:
        raise ValueError(
            f"no compressor state with a payload_bytes counter found in a {type(opt_state).__name__}: pass the "
            "optimizer state of a chain that holds a compjax compressor (or nnx.state of an nnx.Optimizer)"
        )
    return sum(found[1:], found[0])


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

    Args:
      fn: a function or a ``jax.jit``-wrapped function.
      *args, **kwargs: example arguments (arrays or ``jax.ShapeDtypeStruct``).

    Returns:
      A list of :class:`Collective`, in program order.

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
      >>> p, s, loss_per_worker = step(p, s, x)
      >>> int(cj.payload_bytes(s)[0]) == sum(op.bytes for op in ops)
      True
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    text = jitted.lower(*args, **kwargs).compile().as_text()
    types: dict[str, str] = {}
    found = []
    for name, type_text, opcode, operands, attrs in _parse_hlo(text):
        types[name] = type_text
        op = opcode.removesuffix("-start")
        if op in COLLECTIVE_OPS:
            found.append((name, op, operands, _replica_groups(attrs)))
    out = []
    for name, op, operands, groups in found:
        arrays = []
        for o in operands:
            if o.startswith("%") or re.match(r"^[\w.\-]+$", o):
                arrays.extend(_arrays(types.get(o.lstrip("%"), "")))
            else:  # operand printed with its type, e.g. "f32[10]{0} %x"
                arrays.extend(_arrays(o.split("%")[0]))
        out.append(Collective(op, tuple(arrays), _nbytes(arrays), name, groups))
    return out


def _replica_groups(attrs: str) -> tuple | None:
    """``replica_groups`` of an HLO instruction's attribute text, as a tuple of tuples of ids.

    Reads the list form ``{{0,1},{2,3}}`` and the iota form ``[G,S]<=[d0,d1,...]``
    (optionally ``T(perm)``): ``arange(prod(d)).reshape(d).transpose(perm).reshape(G, S)``.
    """
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
