"""``parallel.fsdp_specs`` at its ``min_size`` boundary, against the documented rule: a leaf of **at least**
``min_size`` elements is sharded over the fast axis along its largest dimension the axis size divides (the first on
a tie); smaller leaves, scalars and leaves with no such dimension are held whole."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from compjax import parallel

SLOW, FAST = 2, 4


def documented_rule(shape, min_size, fast, axis="fast"):
    """The docstring of ``fsdp_specs``, written out."""
    if not shape or math.prod(shape) < min_size:
        return P()
    fits = [d for d in range(len(shape)) if shape[d] % fast == 0]
    if not fits:
        return P()
    best = max(fits, key=lambda d: (shape[d], -d))
    return P(*[axis if d == best else None for d in range(len(shape))])


SHAPES = [(8,), (2, 4), (4, 2), (4, 4), (3, 8), (12, 5), (6, 3), (4, 2, 8), (1024,), (32, 32)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_leaf_of_exactly_min_size_elements_is_sharded(shape):
    """min_size at the leaf's size, one above and one below: sharded, whole, sharded (where a dimension fits)."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    size = math.prod(shape)
    for m in (size - 1, size, size + 1):
        if m < 1:
            continue
        got = parallel.fsdp_specs({"x": jnp.zeros(shape)}, mesh, min_size=m)["x"]
        assert got == documented_rule(shape, m, FAST), (shape, m, got)
    exact = parallel.fsdp_specs({"x": jax.ShapeDtypeStruct(shape, jnp.float32)}, mesh, min_size=size)["x"]
    assert (exact != P()) == any(d % FAST == 0 for d in shape)  # at exactly min_size: sharded where a dimension fits
    assert parallel.fsdp_specs({"x": jnp.zeros(shape)}, mesh, min_size=size + 1)["x"] == P()


def test_the_default_min_size_is_inclusive():
    """With the default min_size (1024): a 1024-element layer is sharded, a 1020-element one (4 divides it) is not."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    specs = parallel.fsdp_specs({"at": jnp.zeros((32, 32)), "below": jnp.zeros((255, 4)), "s": jnp.zeros(())}, mesh)
    assert specs == {"at": P("fast", None), "below": P(), "s": P()}
