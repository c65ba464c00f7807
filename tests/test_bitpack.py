"""Bit packing round-trips exactly and lays codes out as documented (32 signs / 16 two-bit codes per uint32)."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compjax.codecs import bitpack


@functools.partial(jax.jit, static_argnums=(1,))
def roundtrip(codes, bits):
    words = bitpack.pack(codes, bits)
    return words, bitpack.unpack(words, bits, codes.shape[0])


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 100_000), st.sampled_from([1, 2, 3, 4, 10]), st.integers(0, 2**16))
def test_roundtrip(n, bits, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=n).astype(np.uint32)
    words, back = roundtrip(codes, bits)
    assert words.dtype == np.uint32 and words.shape == (bitpack.num_words(n, bits),)
    np.testing.assert_array_equal(np.asarray(back), codes)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 100_000, 99_999])
@pytest.mark.parametrize("bits", [1, 2])
def test_roundtrip_at_word_boundaries(n, bits):
    codes = np.random.default_rng(n).integers(0, 2**bits, size=n).astype(np.uint32)
    words, back = roundtrip(codes, bits)
    assert words.shape == (-(-n // (32 // bits)),)  # 32 signs or 16 two-bit codes per word, tail padded
    np.testing.assert_array_equal(np.asarray(back), codes)


def np_pack(codes, bits):
    """Code i of a word in bits [bits*i, bits*(i+1)), little-endian; zero padding."""
    per = 32 // bits
    padded = np.zeros(-(-len(codes) // per) * per, np.uint64)
    padded[: len(codes)] = codes
    w = padded.reshape(-1, per)
    return (w << (np.arange(per, dtype=np.uint64) * bits)).sum(1).astype(np.uint32)


@pytest.mark.parametrize("bits,n", [(1, 32), (1, 33), (2, 16), (2, 31), (4, 9), (8, 5), (16, 3), (32, 2)])
def test_layout_matches_numpy(bits, n):
    codes = np.random.default_rng(n).integers(0, 2**bits, size=n, dtype=np.uint64).astype(np.uint32)
    np.testing.assert_array_equal(np.asarray(bitpack.pack(codes, bits)), np_pack(codes, bits))


@pytest.mark.parametrize("bits,want", [(10, ((0, 8), (8, 2))), (9, ((0, 8), (8, 1))), (3, ((0, 2), (2, 1))),
                                       (7, ((0, 4), (4, 2), (6, 1))), (16, ((0, 16),))])
def test_widths_that_do_not_divide_32_are_split_into_fields(bits, want):
    assert bitpack.fields(bits) == want
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=40).astype(np.uint32)
    words = np.asarray(bitpack.pack(codes, bits))
    expect = np.concatenate([np_pack((codes >> lo) & ((1 << w) - 1), w) for lo, w in want])  # low field first
    np.testing.assert_array_equal(words, expect)
    assert sum(w for _, w in want) == bits and words.size == bitpack.num_words(40, bits)


def test_word_counts():
    assert bitpack.num_words(32, 1) == 1 and bitpack.num_words(33, 1) == 2
    assert bitpack.num_words(16, 2) == 1 and bitpack.num_words(160, 2) == 10
    assert bitpack.num_words(32, 10) == 10 and bitpack.num_words(3200, 10) == 1000  # exactly 10 bits per code
    assert bitpack.num_words(0, 1) == 0
    with pytest.raises(ValueError, match="bits"):
        bitpack.num_words(10, 0)
    with pytest.raises(ValueError, match="bits"):
        bitpack.pack(np.zeros(3, np.uint32), 33)
    with pytest.raises(ValueError, match="words"):
        bitpack.unpack(np.zeros(2, np.uint32), 1, 10)
