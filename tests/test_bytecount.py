"""Exact byte counts in two uint32 words (compjax.bytecount), and compressors' counts above 2**31 bytes.

The compressor checks use gradients of 10**12 bytes that are never built: the
update is compiled with the gradients made inside the jitted function and only
``payload_bytes`` returned, so XLA removes every computation on the gradients
(checked: the compiled program needs no temporary buffer) and the count comes
out of the static shapes alone.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import compjax as cj
from compjax import bytecount

EDGES = [
    0, 1, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 5, 10**12, 2**62, 2**63 - 1,
]
INT64_MAX = 2**63 - 1

_add = jax.jit(bytecount.add)


def words(n):
    return [n % 2**32, n // 2**32]


# --- constant / add / to_int -----------------------------------------------------------------


@pytest.mark.parametrize("n", EDGES)
def test_constant_words_and_round_trip(n):
    c = bytecount.constant(n)
    assert c.dtype == jnp.uint32 and c.shape == (2,)
    assert np.asarray(c).tolist() == words(n)
    assert int(bytecount.to_int(c)) == n
    assert int(bytecount.to_int(bytecount.constant(np.int64(n)))) == n  # NumPy ints too


def test_constant_holds_the_largest_count():
    assert bytecount.MAX == INT64_MAX  # what the host reads back as int64
    assert np.asarray(bytecount.constant(bytecount.MAX)).tolist() == [2**32 - 1, 2**31 - 1]
    assert int(bytecount.to_int(bytecount.constant(bytecount.MAX))) == bytecount.MAX


@pytest.mark.parametrize(
    "a,b",
    [
        (2**32 - 1, 1),  # low word wraps to 0, carry 1
        (2**32 - 1, 2**32 - 1),  # low word wraps to 2**32 - 2, carry 1
        (2**31, 2**31),  # 2**32 exactly
        (2**31 - 1, 1),
        (10**12, 10**12),
        (3 * 2**32 + 2**32 - 1, 2**32 + 2),  # carry into a non-zero high word
        (2**63 - 2**32, 2**32 - 1),  # up to 2**63 - 1
        (0, 2**63 - 1),
    ],
)
def test_add_carries(a, b):
    want = a + b
    assert int(bytecount.to_int(_add(bytecount.constant(a), bytecount.constant(b)))) == want
    assert int(bytecount.to_int(bytecount.add(bytecount.constant(a), b))) == want  # an array and an int
    assert int(bytecount.to_int(bytecount.add(a, bytecount.constant(b)))) == want
    assert int(bytecount.to_int(bytecount.add(a, b))) == want  # two ints: exact constant
    assert int(bytecount.to_int(_add(bytecount.constant(b), bytecount.constant(a)))) == want


@settings(max_examples=200, deadline=None)
@given(st.integers(0, INT64_MAX), st.data())
def test_add_is_exact(a, data):
    b = data.draw(st.integers(0, INT64_MAX - a))
    got = _add(bytecount.constant(a), bytecount.constant(b))
    assert np.asarray(got).tolist() == words(a + b)
    assert int(bytecount.to_int(got)) == a + b


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=50))
def test_running_sum_in_jit_is_exact(steps):
    """A counter that adds one step's bytes at a time, as a training loop's total would."""
    total = bytecount.zeros()
    for n in steps:
        total = _add(total, bytecount.constant(n))
    assert int(bytecount.to_int(total)) == sum(steps)


def test_add_and_to_int_batched():
    ns = np.array([[0, 2**32 - 1], [10**12, 2**31]], object)
    a = jnp.stack([jnp.stack([bytecount.constant(int(n)) for n in row]) for row in ns])
    assert a.shape == (2, 2, 2)
    got = bytecount.to_int(_add(a, a))
    assert got.dtype == np.int64 and got.shape == (2, 2)
    assert got.tolist() == [[2 * int(n) for n in row] for row in ns]


def test_zeros_is_a_new_zero_count():
    z1, z2 = bytecount.zeros(), bytecount.zeros()
    assert z1.dtype == jnp.uint32 and np.asarray(z1).tolist() == [0, 0] and z1 is not z2


@pytest.mark.parametrize("n", [-1, -(2**40), 2**63, 2**64, 2**70, 1.5, 3.0, True, False, "3", None, np.float32(2)])
def test_constant_bad_input(n):
    with pytest.raises(ValueError, match="byte count"):
        bytecount.constant(n)


@pytest.mark.parametrize("n", [-1, 2**63, 2**64])
def test_add_of_ints_out_of_range_raises(n):
    with pytest.raises(ValueError, match="byte count"):
        bytecount.add(n, 0)


@pytest.mark.parametrize(
    "w", [np.uint32(5), np.zeros(3, np.uint32), np.zeros((2, 3), np.uint32), np.zeros(0)]
)
def test_to_int_bad_shape(w):
    with pytest.raises(ValueError, match=r"\(\.\.\., 2\)"):
        bytecount.to_int(w)


# --- compressors' counts above 2**31 bytes, without the memory ------------------------------


def _payload_state(tx, shapes, dtype=jnp.float32):
    """The state after one ``tx.update`` on zero gradients of ``shapes``, without materializing them.

    Returns the new state with its per-parameter fields dropped (``count``,
    ``skipped``, ``payload_bytes`` and the small fields).
    """

    def step():
        grads = {f"l{i}": jnp.zeros(s, dtype) for i, s in enumerate(shapes)}
        _, state = tx.update(grads, tx.init(grads))
        return state._replace(**{f: None for f in ("residual",) if f in state._fields})

    compiled = jax.jit(step).lower().compile()
    mem = compiled.memory_analysis()
    # The gradients are dead code: nothing of their size may be allocated (guards the test machine).
    assert mem is None or mem.temp_size_in_bytes + mem.output_size_in_bytes < 2**20, mem
    return compiled()


HUGE = [(250_000, 1_000_000)]  # 2.5e11 float32 entries: 10**12 bytes
HUGE_SPLIT = [(123_457, 1_000_000), (126_543, 1_000_000)]  # the same bytes in two layers


@pytest.mark.parametrize("shapes", [HUGE, HUGE_SPLIT], ids=["one_layer", "two_layers"])
def test_identity_counts_a_terabyte(shapes):
    state = _payload_state(cj.identity(axis_name=None), shapes)
    assert int(cj.message_bytes(state)) == 10**12
    assert bytecount.to_int(state.payload_bytes) == 10**12 and not bytecount.is_sent(state.payload_bytes)


def test_twobit_counts_above_2_pow_32():
    state = _payload_state(cj.twobit(0.5), HUGE)
    want = 4 * math.ceil(250_000 * 1_000_000 / 16)  # 2-bit codes, 16 per uint32 word
    assert want > 2**35
    assert int(cj.message_bytes(state)) == want


@pytest.mark.parametrize(
    "shapes,lo,hi",
    [([(30_000, 30_000)], 2**31, 2**32), ([(20_000, 30_000), (30_000, 20_000)], 2**32, 2**33)],
    ids=["above_2_pow_31", "above_2_pow_32"],
)
def test_topk_counts_above_2_pow_31(shapes, lo, hi):
    # Flat int32 indices into all layers limit top-k to < 2**31 entries in all.
    ratio = 0.5
    state = _payload_state(cj.topk(ratio), shapes)
    want = sum(math.ceil(ratio * math.prod(s)) * (4 + 4) for s in shapes)  # int32 index + float32 value each
    assert lo < want < hi
    assert int(cj.message_bytes(state)) == want


def test_identity_float16_counts_two_bytes_an_entry():
    state = _payload_state(cj.identity(axis_name=None), HUGE, jnp.float16)
    assert int(cj.message_bytes(state)) == 2 * 250_000 * 1_000_000
