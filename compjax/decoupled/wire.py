"""What travels: a compressor's encoded message as arrays (its payload), and how the syncer decodes it.

A compjax compressor hands its encoded message to a collective of :mod:`compjax.collectives`
(e.g. one uint32 buffer of packed codes and one float32 buffer of scales to ``gathered_mean``).
A learner has no worker axis (``axis_name=None``): no collective runs, so the learner's
encoder traces the compressor's ``update`` under :func:`compjax.collectives.capture` and gets
those arrays as outputs; they are what the transport carries, and their bytes are what
:func:`compjax.message_bytes` counts.  The syncer traces the same compressor's ``update`` on
zeros under :func:`compjax.collectives.replay` with the received arrays: the collectives decode
them instead of their own operands, so the syncer gets the outer gradient exactly as the
learner's compressor decoded it (its error feedback subtracts the same values).

Zero-size payload arrays (an unused buffer, e.g. raw values of a compressor that sends codes)
do not travel; the decoder fills them in from its own trace.  Floats that NumPy has no dtype
string for (bfloat16, the float8 formats) travel bitcast to unsigned integers of the same width,
as :mod:`compjax.collectives` sends them through all-gathers (no data moves; bit for bit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import collectives
from compjax.compressors.identity import identity
from compjax.decoupled.messages import message_bytes

#: ``((shape, dtype name), ...)``: a fragment's leaves, the hashable key of its decoder.
Like = tuple[tuple[tuple[int, ...], str], ...]


@functools.cache
def default_compressor() -> optax.GradientTransformation:
    """float32 outer gradients, exact (:func:`compjax.identity`, no worker axis): one instance per process."""
    return identity(None, skip_nonfinite=False)


def like_of(arrays: Sequence) -> Like:
    """The hashable ``((shape, dtype name), ...)`` of ``arrays`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return tuple((tuple(int(d) for d in x.shape), jnp.dtype(x.dtype).name) for x in arrays)


def _wire_dtype(dtype) -> Any:
    """The dtype an array of ``dtype`` travels as: itself, or the unsigned integer of its width for a float
    whose NumPy dtype string does not name it (bfloat16, float8: ``'<V2'``, ``'|V1'``)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).kind == "V":
        return jnp.dtype({1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dtype.itemsize])
    return dtype


def _to_wire(x: jax.Array) -> jax.Array:
    wire = _wire_dtype(x.dtype)
    return x if wire == x.dtype else jax.lax.bitcast_convert_type(x, wire)


def _skipped(state: Any) -> jnp.ndarray:
    """The sum of every int32 field named ``skipped`` in ``state`` (steps the non-finite guard skipped)."""
    total = jnp.zeros((), jnp.int32)

    def add(path, x):
        nonlocal total
        last = path[-1] if path else None
        if getattr(last, "name", getattr(last, "key", None)) == "skipped":
            total = total + jnp.asarray(x, jnp.int32).sum()

    jax.tree_util.tree_map_with_path(add, state)
    return total


@functools.cache
def encoder(compressor: optax.GradientTransformation) -> Callable:
    """``(outer_gradient, comm_state) -> (decoded, comm_state, payload, skipped)``, jitted once per compressor.

    ``decoded``: the compressor's output (its decoding of its own message, float32 leaves of the
    fragment); ``payload``: the tuple of the message's non-empty arrays (:func:`compjax.collectives.capture`;
    bfloat16 and float8 ones bitcast to unsigned integers);
    ``skipped``: a boolean scalar, true when the compressor's non-finite guard skipped this update
    (its output is then zeros and its state unchanged, but its payload encodes the residual alone).
    """

    def encode(delta, state):
        with collectives.capture() as cap:
            decoded, new = compressor.update(delta, state)
        payload = tuple(_to_wire(a) for a in cap.arrays if a.size)
        return decoded, new, payload, _skipped(new) > _skipped(state)

    return jax.jit(encode)


@functools.cache
def _full_spec(compressor: optax.GradientTransformation, like: Like) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Every array the compressor's message holds for leaves ``like`` (empty ones included), from one trace."""
    leaves = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in like]

    def trace(delta):
        with collectives.capture() as cap:
            compressor.update(delta, compressor.init(delta))
        return tuple(cap.arrays)

    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.eval_shape(trace, leaves))


def payload_spec(compressor: optax.GradientTransformation, like: Like) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes and dtypes of the payload arrays that travel for a fragment of leaves ``like``.

    Raises:
      ValueError: the compressor's ``update`` cannot be traced with its payload captured.
    """
    try:
        full = _full_spec(compressor, like)
    except Exception as e:  # any tracing error: this message cannot be captured
        raise ValueError(f"compressor {describe(compressor)} cannot send its message as arrays: "
                         f"{type(e).__name__}: {e}") from e
    return tuple(jax.ShapeDtypeStruct(s.shape, _wire_dtype(s.dtype)) for s in full if s.size)


@functools.cache
def decoder(compressor: optax.GradientTransformation, like: Like) -> Callable:
    """``payload -> decoded``: the fragment's outer gradient (leaves of ``like``) from its payload arrays.

    Jitted once per compressor and fragment; ``payload`` must be of :func:`payload_spec`'s shapes
    and dtypes (checked by the caller before anything is received).
    """
    full = _full_spec(compressor, like)
    return jax.jit(lambda payload: _decoded(compressor, like, full, payload))


def _decoded(compressor: optax.GradientTransformation, like: Like, full: tuple, payload: Any) -> list:
    """The compressor's decoding of ``payload`` (traced): its captured collectives replayed on fresh state."""
    given = iter(payload)
    arrays = [jax.lax.bitcast_convert_type(next(given), s.dtype) if s.size else jnp.zeros(s.shape, s.dtype)
              for s in full]
    zeros = [jnp.zeros(s, jnp.dtype(d)) for s, d in like]
    with collectives.replay(arrays):
        decoded, _ = compressor.update(zeros, compressor.init(zeros))
    return list(decoded)


@functools.cache
def applier(compressor: optax.GradientTransformation, like: Like) -> Callable:
    """``(old, payload) -> new``: ``old + decoded`` leaf by leaf, the decoding of :func:`decoder`, in one jitted program.

    The syncer's compressed replies (:class:`~compjax.decoupled.Syncer`'s ``reply_compressor``):
    the syncer applies to its global values exactly what a learner applies to its anchor, with the
    same compiled program, so the two stay bit-identical (float32 additions of the same operands).
    ``old``: the leaves of ``like`` (float32 or wider); ``payload``: :func:`payload_spec`'s arrays.
    """
    full = _full_spec(compressor, like)

    def apply(old, payload):
        decoded = _decoded(compressor, like, full, payload)
        return [jnp.asarray(o) + d.astype(jnp.asarray(o).dtype) for o, d in zip(old, decoded)]

    return jax.jit(apply)


def describe(compressor: Any) -> str:
    """A name for ``compressor`` in messages: the type of its state (``TopkState``; a chain's, joined) or its repr."""
    try:
        state = jax.eval_shape(compressor.init, [jax.ShapeDtypeStruct((8,), jnp.float32)])
    except Exception:  # noqa: BLE001 - a name for an error message only
        return repr(compressor)
    if type(state) in (tuple, list):  # optax.chain: the states of its parts
        return "chain(" + ", ".join(type(x).__name__ for x in state) + ")"
    return type(state).__name__


def check_capturable(compressor: optax.GradientTransformation, state: Any, like: Like) -> None:
    """Raise unless the compressor's message travels as its captured payload, for a fragment of leaves ``like``.

    Two updates on fixed pseudo-random outer gradients (from ``state``, a learner's own
    compressor state; nothing is kept): each payload's bytes must be what
    :func:`compjax.message_bytes` counts (else the compressor sends something no intercepted
    collective carries), and the syncer's decoding of it (:func:`decoder`, from a fresh state)
    must equal the learner's decoded value (else the decoding needs state that does not
    travel).  Equality is up to ``1e-6`` relative to the largest decoded magnitude (two
    compiled programs may fuse floating-point operations differently).

    Raises:
      ValueError: naming the compressor (:func:`describe`) and what differs.
    """
    name = describe(compressor)
    try:
        encode, decode = encoder(compressor), decoder(compressor, like)
        rng = np.random.default_rng(20240)
        for _ in range(2):
            delta = [jnp.asarray(rng.normal(size=s) * 0.01, jnp.dtype(d)) for s, d in like]
            decoded, state, payload, _ = encode(delta, state)
            sent, counted = sum(int(np.asarray(x).nbytes) for x in payload), message_bytes(state)
            if sent != counted:
                raise ValueError(f"its payload arrays hold {sent} bytes but it counts {counted} (a part of its "
                                 "message goes through a collective that is not captured)")
            got = decode(payload)
            for j, (a, b) in enumerate(zip(decoded, got)):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                tol = 1e-6 * max(1.0, float(np.max(np.abs(a), initial=0.0)))
                if a.shape != b.shape or not np.allclose(a, b, rtol=0.0, atol=tol):
                    raise ValueError(f"the syncer's decoding of leaf {j} differs from the learner's (its decoding "
                                     "needs state that does not travel)")
    except ValueError as e:
        raise ValueError(f"compressor {name} cannot send its encoded message to a syncer: {e}") from e
    except Exception as e:  # a tracing error, e.g. a payload captured inside a branch
        raise ValueError(f"compressor {name} cannot send its encoded message to a syncer: "
                         f"{type(e).__name__}: {e}") from e
