"""Values that are bit for bit what they were, but that XLA must compute in a given order or place.

XLA orders operations by their data only, fuses elementwise passes into the
passes that read them (recomputing them there) and hoists loop-invariant work
out of loops.  On a large model each of these can keep a whole-model buffer
alive: two independent all-reduces combined into one instruction hold every
operand and result at once; an accumulation fused into three readers keeps its
inputs alive until the last of them; a float32 widening of bfloat16 gradients
hoisted out of a loop is a float32 copy of the gradients.  The helpers below
add a data dependency, or a boundary, that XLA keeps and that changes no bit:

* :func:`zero_after` / :func:`after`: ``x`` computed after another array
  (a select on a 0 that is read from that array);
* :func:`one_trip`: the integer 1, from a step count, not known to the
  compiler: a ``fori_loop`` of this many trips stays a loop (a loop's carry is
  written in place; XLA neither fuses across its boundary nor hoists its body);
* :func:`settled`: a tree passed through such a loop: every leaf written to
  memory once, before anything reads it;
* :func:`tie`: a value read inside a loop as the loop's own (selected on the
  trip index), so that nothing computed from it leaves the loop.

The memory each one saves is measured where it is used (the memory benchmark,
``experiments/benchmarks/memory.py``, 8B model on a 2 x 4 mesh).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["after", "one_trip", "settled", "tie", "zero_after"]

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def zero_after(prev: jnp.ndarray) -> jnp.ndarray | None:
    """A uint32 scalar that is always 0 but that XLA must compute from ``prev`` (its first word).

    XLA computes that word by the cheapest path: through an elementwise
    producer (a cast, a product) it reads the producer's inputs, not the
    whole result, so the token waits for the nearest non-elementwise producer
    (a scatter, a reduction, a loop, a collective) and not for the passes
    after it.

    Args:
      prev: any array.

    Returns:
      a uint32 scalar 0, or None when ``prev`` is empty (nothing to wait for).
    """
    word = jnp.ravel(prev)[:1]
    if word.size == 0:
        return None
    bits = _UINT[jnp.dtype(word.dtype).itemsize]
    return jnp.minimum(jax.lax.bitcast_convert_type(word, bits), 0)[0].astype(jnp.uint32)


def after(x: jnp.ndarray, token: jnp.ndarray | None) -> jnp.ndarray:
    """``x`` unchanged (bit for bit), computed after the array ``token`` was read from (:func:`zero_after`).

    A select on ``token == 1`` (never true, not known to the compiler); the
    compare and the select fuse into the pass that writes ``x``.  A bfloat16 or
    float16 ``x`` is selected through its bits, as in :func:`tie` (XLA:CPU's
    elemental emitters compute a bfloat16 selection in float32, which turns a
    NaN's payload into the canonical one).

    Args:
      x: any array.
      token: a uint32 scalar from :func:`zero_after` (always 0), or None (``x`` as it is).

    Returns:
      ``x``: same shape, dtype and bits.
    """
    return x if token is None else _keep(x, token == 1)


def one_trip(count: jnp.ndarray) -> jnp.ndarray:
    """``1 + min(count, 0)``: the int32 1 for a step count ``count >= 0``, not known to the compiler.

    Args:
      count: an integer scalar, at least 0 (a transformation's step count).

    Returns:
      an int32 scalar, 1.
    """
    return (1 + jnp.minimum(count, 0)).astype(jnp.int32)


def tie(x: jnp.ndarray, i: jnp.ndarray) -> jnp.ndarray:
    """``x`` bit for bit, selected on a loop's trip index ``i >= 0`` (``i < 0`` never holds): read as the loop's.

    A floating-point ``x`` narrower than 32 bits (bfloat16, float16) is
    selected through the unsigned integer of its width: XLA:CPU computes a
    bfloat16 selection in float32, and hoisted the float32 copy of a
    loop-invariant operand out of the loop (DiLoCo's guarded inner step over
    the bfloat16 gradients of an 8B model, 2 x 4 mesh, sharded: 7.4 GiB of
    float32 temporaries where the bfloat16 ones take 3.7 GiB).  Wider floats
    (selected through their bits, XLA kept copies of them) and other dtypes
    are selected as they are.

    Args:
      x: any array.
      i: the trip index of the enclosing ``fori_loop`` (int32 scalar).

    Returns:
      ``x``: same shape, dtype and bits.
    """
    return _keep(x, i < 0)


def _keep(x: jnp.ndarray, never: jnp.ndarray) -> jnp.ndarray:
    """``x`` bit for bit: zeros where the boolean scalar ``never`` (never true) holds, selected as :func:`tie` says."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize >= 4:
        return jnp.where(never, jnp.zeros_like(x), x)
    bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    return jax.lax.bitcast_convert_type(jnp.where(never, jnp.zeros_like(bits), bits), x.dtype)


def settled(tree: Any, count: jnp.ndarray) -> Any:
    """``tree`` unchanged (bit for bit), each leaf written to memory once before anything reads it.

    A loop of :func:`one_trip` trips whose body selects each leaf on ``i < 0``
    (never true; :func:`tie`, so a 16-bit float keeps its bits): a boundary XLA neither fuses across nor removes, so a leaf is not
    recomputed in every pass that reads it, nor written by a pass scheduled
    after its readers.

    Args:
      tree: a pytree of arrays.
      count: an integer scalar, at least 0 (a step count).

    Returns:
      ``tree``: the same structure, shapes, dtypes and bits.
    """
    def body(i, t):
        return jax.tree.map(lambda x: tie(x, i), t)

    return jax.lax.fori_loop(0, one_trip(count), body, tree)
