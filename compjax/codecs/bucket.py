"""Bucketing: many arrays in one flat buffer, so one collective serves all layers.

A :class:`Bucket` is static metadata (shapes, sizes, offsets) computed once from
the leaves' shapes at trace time; ``flatten`` concatenates the raveled leaves,
``unflatten`` splits a flat buffer back.  Shapes are static, so XLA sees plain
concatenate/slice ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp


class Bucket(NamedTuple):
    """Static layout of a flat buffer holding several arrays.

    Attributes:
      shapes: shape of each array, in order.
      sizes: number of elements of each array.
      offsets: start of each array in the flat buffer (elements).
      size: total number of elements.
    """

    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int

    def flatten(self, arrays: Sequence[jnp.ndarray], dtype=None) -> jnp.ndarray:
        """Concatenate ``arrays`` (raveled) into one 1-D buffer of ``self.size`` elements."""
        if len(arrays) != len(self.shapes):
            raise ValueError(f"bucket holds {len(self.shapes)} arrays, got {len(arrays)}")
        if not arrays:
            return jnp.zeros((0,), dtype or jnp.float32)
        flat = [jnp.ravel(a) if dtype is None else jnp.ravel(a).astype(dtype) for a in arrays]
        return flat[0] if len(flat) == 1 else jnp.concatenate(flat)

    def unflatten(self, flat: jnp.ndarray) -> list[jnp.ndarray]:
        """Split a 1-D buffer of ``self.size`` elements back into arrays of ``self.shapes``."""
        if flat.shape != (self.size,):
            raise ValueError(f"expected a flat buffer of shape ({self.size},), got {flat.shape}")
        return [
            flat[o : o + n].reshape(s) for s, n, o in zip(self.shapes, self.sizes, self.offsets)
        ]


def make_bucket(shapes: Sequence[Sequence[int]]) -> Bucket:
    """Build the static layout of a bucket for arrays of the given shapes."""
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    sizes = tuple(math.prod(s) for s in shapes)
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += n
    return Bucket(shapes, sizes, tuple(offsets), total)


#: Largest flat buffer (bytes) :func:`compjax.collectives.dense_mean_arrays` builds for one all-reduce: 64 MiB.
#: Larger buckets would copy a whole model's gradients into one buffer (as many bytes again as the
#: gradients themselves); an array larger than this is reduced on its own, without a copy.
BUCKET_CAP_BYTES = 64 * 2**20


def group_by_size(nbytes: Sequence[int], cap: int = BUCKET_CAP_BYTES) -> list[list[int]]:
    """Consecutive groups of indices whose bytes sum to at most ``cap`` each; an item above ``cap`` alone.

    Args:
      nbytes: the bytes of each item (arrays in bucket order), non-negative ints.
      cap: the largest sum of a group (bytes), a positive int.

    Returns:
      The groups, lists of indices into ``nbytes`` in their order, covering
      every index once (``[]`` for no items).  Items stay in order: the
      concatenation of the groups is ``range(len(nbytes))``.

    Raises:
      ValueError: ``cap`` not a positive int, or a negative entry of ``nbytes``.

    Examples:
      >>> group_by_size([10, 20, 50, 5, 5], cap=40)
      [[0, 1], [2], [3, 4]]
    """
    if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
        raise ValueError(f"cap must be a positive int (bytes), got {cap!r}")
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(nbytes):
        if n < 0:
            raise ValueError(f"nbytes[{i}] must be >= 0, got {n}")
        if groups and total + n <= cap:
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups
