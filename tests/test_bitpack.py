"""Bit packing round-trips exactly and lays codes out as documented."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compjax.codecs import bitpack


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 100_000), st.sampled_from([1, 2, 3, 4, 10]), st.integers(0, 2**16))
def test_roundtrip(n, bits, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=n).astype(np.uint32)
    words = bitpack.pack(codes, bits)
    assert words.dtype == np.uint32 and words.shape == (bitpack.num_words(n, bits),)
    np.testing.assert_array_equal(np.asarray(bitpack.unpack(words, bits, n)), codes)


def np_pack(codes, bits):
    per = 32 // bits
    padded = np.zeros(-(-len(codes) // per) * per, np.uint64)
    padded[: len(codes)] = codes
    w = padded.reshape(-1, per)
    return (w << (np.arange(per, dtype=np.uint64) * bits)).sum(1).astype(np.uint32)


@pytest.mark.parametrize("bits,n", [(1, 32), (1, 33), (2, 16), (2, 31), (4, 9)])
def test_layout_matches_numpy(bits, n):
    codes = np.random.default_rng(n).integers(0, 2**bits, size=n).astype(np.uint32)
    np.testing.assert_array_equal(np.asarray(bitpack.pack(codes, bits)), np_pack(codes, bits))


def test_word_counts():
    assert bitpack.num_words(32, 1) == 1 and bitpack.num_words(33, 1) == 2
    assert bitpack.num_words(16, 2) == 1 and bitpack.num_words(160, 2) == 10
    assert bitpack.num_words(32, 10) == 10  # ten bit-planes of one word each
    with pytest.raises(ValueError, match="bits"):
        bitpack.num_words(10, 0)
