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
