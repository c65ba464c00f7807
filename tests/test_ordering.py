"""compjax.codecs.ordering: every helper gives its input bit for bit, with the dependency or boundary XLA keeps."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from compjax.codecs import ordering

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint8, jnp.bool_]


def _odd_values(dtype):
    """Values whose bits a float round trip would change: NaN with a payload, -0.0, infinities, subnormals."""
    if jnp.issubdtype(dtype, jnp.floating):
        bits = np.array([0x7FC1, 0x8000, 0x7F80, 0x0001, 0x3F80], np.uint16)
        if jnp.dtype(dtype).itemsize == 4:
            bits = np.array([0x7FC00123, 0x80000000, 0x7F800000, 0x00000001, 0x3F800000], np.uint32)
        return jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype)
    return jnp.asarray([0, 1, 2, 3, 1]).astype(dtype)


def _bits(x):
    x = np.asarray(x)
    return x.view(f"uint{8 * x.itemsize}") if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else x


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_each_helper_gives_its_input_bit_for_bit(dtype):
    x = _odd_values(dtype)
    count = jnp.int32(7)

    def all_of(x, y, count):
        token = ordering.zero_after(y)

        def body(i, carry):
            return ordering.tie(carry, i)

        looped = jax.lax.fori_loop(0, ordering.one_trip(count), body, x)
        return ordering.after(x, token), looped, ordering.settled({"a": x, "b": [x]}, count)

    after, looped, settled = jax.jit(all_of)(x, jnp.arange(3.0), count)
    for got in (after, looped, settled["a"], settled["b"][0]):
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(_bits(got), _bits(x))


def test_zero_after_is_a_uint32_zero_read_from_its_argument_and_none_for_an_empty_one():
    for y in (jnp.array([-3.5, 2.0]), jnp.array([7], jnp.int8), jnp.array([1.0], jnp.bfloat16)):
        z = jax.jit(ordering.zero_after)(y)
        assert z.dtype == jnp.uint32 and z.shape == () and int(z) == 0
    assert ordering.zero_after(jnp.zeros((0,))) is None
    assert ordering.after(jnp.ones(2), None) is not None
    jaxpr = jax.make_jaxpr(lambda x, y: ordering.after(x, ordering.zero_after(y)))(jnp.ones(3), jnp.ones(4)).jaxpr
    tainted = {jaxpr.invars[1]}  # y, and every value computed from it
    for eqn in jaxpr.eqns:
        if any(v in tainted for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)):
            tainted.update(eqn.outvars)
    assert jaxpr.outvars[0] in tainted, "the result does not depend on y: XLA may compute it first"


def test_one_trip_is_one_and_the_loops_stay_loops():
    assert int(jax.jit(ordering.one_trip)(jnp.int32(5))) == 1
    assert ordering.one_trip(jnp.int32(0)).dtype == jnp.int32
    text = jax.jit(ordering.settled).lower({"w": jnp.ones(8)}, jnp.int32(3)).compile().as_text()
    assert "while" in text, "the one-trip loop was removed: it is no boundary"
