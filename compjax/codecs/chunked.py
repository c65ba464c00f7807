"""Chunk-wise top-k with packed chunk-local indices, an optional DCT per chunk, and quantized kept values.

The codec of SparseLoCo (Sarfi et al. 2025) and DeMo (Peng et al. 2024); pure array math, no collectives.

**Chunks** follow the reference code's ``ChunkingTransform`` (tplr-ai/SparseLoCo
``src/tplr/sparseloco.py``; bloc97/DeMo ``demo.py``, ``TransformDCT``): a layer is viewed as a matrix
``(rows, cols)`` (a vector as ``(1, n)``, a scalar as ``(1, 1)``, a tensor of higher rank as
``(prod(shape[:-1]), shape[-1])``) and cut into tiles of ``h x w`` entries, where ``h`` is the largest
divisor of ``rows`` at most ``chunk`` and ``w`` the largest divisor of ``cols`` at most ``chunk``
(``_get_smaller_split`` in the reference): no padding, ever.  Tile ``(y, x)`` holds
``M[y h : (y + 1) h, x w : (x + 1) w]``, raveled row-major into a row of length ``L = h w`` of a
``(tiles, L)`` array (``rearrange(x, "(y h) (x w) -> y x (h w)")``).

**DCT** (DeMo): each tile goes through the orthonormal type-II DCT along both axes,
``C_h T C_w^T`` (``C_n[b, j] = s_b cos(pi (2 j + 1) b / (2 n))``, ``s_0 = sqrt(1/n)``, ``s_b = sqrt(2/n)``),
as ``TransformDCT.encode``; the inverse is ``C_h^T T C_w``.

**Top-k per tile**: the ``k`` entries of largest magnitude of every row (``jax.lax.top_k``: ties to
the lowest index).  Their positions inside the tile, ``0 .. L - 1``, are sent in
``index_bits(L) = ceil(log2 L)`` bits each, packed into uint32 words (:mod:`compjax.codecs.bitpack`;
12 bits for a 64 x 64 tile, instead of a 4-byte flat offset).

**Values** go through a quantizer that takes any vector of values:

* ``"statistical"``: SparseLoCo's ``TopKCompressor._quantize``: over a layer's ``n`` kept values ``v``,
  ``shift = mean(v)``, ``c = v - shift``, ``scale = range_sigmas * std(c) / bins`` (``std`` with
  ``n - 1``; ``scale = 1`` when it is 0 or not finite), code ``= clip(round(c / scale + bins // 2), 0,
  bins - 1)`` (round half to even); the receiver maps a code to ``lookup[code] + shift``, ``lookup[b]``
  the mean of the ``c`` whose code is ``b`` (0 for an empty bin).  ``bits`` bits per value and
  ``1 + 2**bits`` float32 per layer (``shift`` and ``lookup``).
* ``"sign"``: the scaled sign of EF-signSGD over the kept values, ``mean(|v|) sign(v)``: 1 bit per
  value and one float32 per layer.
* ``"float32"``, ``"bfloat16"``, ``"float16"``: the values themselves in that dtype.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ChunkLayout", "CountDigits", "chunk_k", "chunk_layout", "count_digits", "count_senders", "dct_matrix", "dct_tiles",
    "idct_tiles", "index_bits", "scatter_layer", "scatter_rows", "sent_digits", "split_size", "statistical_decode", "statistical_encode", "tile", "tile_positions", "topk_rows",
    "untile",
]


def split_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (the reference's ``_get_smaller_split``).

    Examples:
      >>> split_size(256, 64), split_size(65, 64), split_size(67, 64), split_size(12, 64)
      (64, 13, 1, 12)
    """
    if target >= n:
        return n
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for c in (d, n // d):
                if best < c <= target:
                    best = c
    return best


class ChunkLayout(NamedTuple):
    """How a layer is cut into tiles (static).

    Attributes:
      shape: the layer's shape.
      rows, cols: the matrix view ``(rows, cols)``.
      h, w: tile height and width (divisors of ``rows`` and ``cols``).
      tiles: number of tiles, ``rows cols / (h w)``.
      length: entries per tile, ``L = h w``.
    """

    shape: tuple
    rows: int
    cols: int
    h: int
    w: int
    tiles: int
    length: int


def chunk_layout(shape, chunk: int) -> ChunkLayout:
    """The tiles of a layer of ``shape`` for a target tile side ``chunk`` (see the module docstring).

    Examples:
      >>> chunk_layout((128, 96), 64)
      ChunkLayout(shape=(128, 96), rows=128, cols=96, h=64, w=48, tiles=4, length=3072)
      >>> chunk_layout((65,), 64).length
      13
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0:
        rows, cols = 1, 1
    elif len(shape) == 1:
        rows, cols = 1, shape[0]
    else:
        rows, cols = math.prod(shape[:-1]), shape[-1]
    h, w = split_size(rows, chunk), split_size(cols, chunk)
    return ChunkLayout(shape, rows, cols, h, w, (rows // h) * (cols // w), h * w)


def chunk_k(layout: ChunkLayout, k: int, chunk: int, proportional: bool) -> int:
    """Entries kept per tile: ``max(1, round(L k / chunk**2))`` (SparseLoCo, ``proportional``) or ``min(k, L)`` (DeMo).

    SparseLoCo's ``SparseLoCo.step`` scales ``top_k`` (given per full ``chunk x chunk`` tile) to a
    smaller tile's length (Python's ``round``: half to even); DeMo's ``CompressDCT._clamp_topk`` clamps it.
    """
    if proportional:
        return int(min(layout.length, max(1, round(layout.length * k / chunk**2))))
    return int(min(layout.length, max(1, k)))


def index_bits(length: int) -> int:
    """Bits of a position inside a tile of ``length`` entries: ``ceil(log2 length)`` (0 for one entry)."""
    return (int(length) - 1).bit_length()


def tile(x: jnp.ndarray, layout: ChunkLayout) -> jnp.ndarray:
    """``x`` as ``(tiles, L)``: tile ``(y, x)`` raveled row-major, tiles in row-major order."""
    m = jnp.reshape(x, (layout.rows // layout.h, layout.h, layout.cols // layout.w, layout.w))
    return jnp.transpose(m, (0, 2, 1, 3)).reshape(layout.tiles, layout.length)


def untile(t: jnp.ndarray, layout: ChunkLayout) -> jnp.ndarray:
    """Inverse of :func:`tile`: an array of ``layout.shape``."""
    m = jnp.reshape(t, (layout.rows // layout.h, layout.cols // layout.w, layout.h, layout.w))
    return jnp.transpose(m, (0, 2, 1, 3)).reshape(layout.shape)


@cache
def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal type-II DCT matrix ``C`` of size ``n`` (float64, read-only use).

    ``C @ x`` is ``scipy.fft.dct(x, norm="ortho")``; ``C.T`` is its inverse.
    """
    j = np.arange(n)
    c = np.cos(np.pi * (2 * j[None, :] + 1) * j[:, None] / (2 * n)) * np.sqrt(2.0 / n)
    c[0] /= np.sqrt(2.0)
    return c


def dct_tiles(t: jnp.ndarray, layout: ChunkLayout) -> jnp.ndarray:
    """The 2-D orthonormal DCT-II of every tile, ``C_h T C_w^T``: ``(tiles, L)`` float32 coefficients."""
    ch = jnp.asarray(dct_matrix(layout.h), jnp.float32)
    cw = jnp.asarray(dct_matrix(layout.w), jnp.float32)
    m = jnp.reshape(t.astype(jnp.float32), (layout.tiles, layout.h, layout.w))
    out = jnp.einsum("bh,thw,dw->tbd", ch, m, cw, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(layout.tiles, layout.length)


def idct_tiles(c: jnp.ndarray, layout: ChunkLayout) -> jnp.ndarray:
    """Inverse of :func:`dct_tiles`, ``C_h^T T C_w``: ``(tiles, L)`` float32."""
    ch = jnp.asarray(dct_matrix(layout.h), jnp.float32)
    cw = jnp.asarray(dct_matrix(layout.w), jnp.float32)
    m = jnp.reshape(c.astype(jnp.float32), (layout.tiles, layout.h, layout.w))
    out = jnp.einsum("bh,tbd,dw->thw", ch, m, cw, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(layout.tiles, layout.length)


def topk_rows(t: jnp.ndarray, k: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The ``k`` entries of largest magnitude of every row of ``t`` ``(tiles, L)``.

    Returns:
      ``(idx, values)``: int32 ``(tiles, k)`` positions in each row (ties to the lowest index) and the
      ``(tiles, k)`` values there, in ``t.dtype``.
    """
    if k == t.shape[-1]:
        idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), t.shape)
        return idx, t
    _, idx = jax.lax.top_k(jnp.abs(t), k)
    idx = idx.astype(jnp.int32)
    return idx, jnp.take_along_axis(t, idx, axis=-1)


def scatter_rows(idx: jnp.ndarray, values: jnp.ndarray, length: int) -> jnp.ndarray:
    """A dense ``(tiles, length)`` array: ``values`` at ``idx`` (distinct within a row), zeros elsewhere."""
    tiles = idx.shape[0]
    rows = jnp.broadcast_to(jnp.arange(tiles, dtype=jnp.int32)[:, None], idx.shape)
    return jnp.zeros((tiles, length), values.dtype).at[rows, idx].set(values, unique_indices=True)


def tile_positions(idx: jnp.ndarray, layout: ChunkLayout) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Where positions inside tiles lie in the layer's matrix view: ``(row, col)`` int32 arrays like ``idx``.

    Args:
      idx: integer ``(tiles, k)``: row ``t`` holds positions ``0 .. L - 1`` inside tile ``t`` (row-major in
        the tile, tiles in :func:`tile`'s order).
      layout: the tiles (:func:`chunk_layout`).

    Returns:
      ``(row, col)``: int32 ``(tiles, k)`` coordinates in the ``(rows, cols)`` matrix view, each below
      ``2**31`` for any layer whose rows and columns are (no flat index into the whole layer is formed).
    """
    per_row = layout.cols // layout.w
    t = jnp.arange(layout.tiles, dtype=jnp.int32)[:, None]
    idx = idx.astype(jnp.int32)
    row = (t // per_row) * layout.h + idx // layout.w
    col = (t % per_row) * layout.w + idx % layout.w
    return row, col


def scatter_layer(idx: jnp.ndarray, values: jnp.ndarray, layout: ChunkLayout, into: jnp.ndarray | None = None,
                  *, sign: float = 1.0) -> jnp.ndarray:
    """``values`` at tile positions ``idx``, written straight into an array of ``layout.shape`` (no tiled copy).

    ``untile(scatter_rows(idx, values, layout.length), layout)`` in one scatter into the layer's matrix
    view, or, with ``into``, ``into + sign * that`` as a scatter-add into ``into`` (which XLA may update in
    place: the error feedback's ``e - sent`` without a dense ``sent``).  Positions are distinct within a
    tile, so the two agree exactly with the dense forms.

    Args:
      idx: integer ``(tiles, k)`` positions inside the tiles (:func:`topk_rows`).
      values: ``(tiles, k)`` values there.
      layout: the tiles (:func:`chunk_layout`).
      into: None (zeros of ``values``' dtype) or an array of ``layout.shape``.
      sign: ``1.0`` or ``-1.0``, the sign the values are added with into ``into``.

    Returns:
      An array of ``layout.shape``, in ``values``' dtype (``into``'s with ``into``).
    """
    row, col = tile_positions(idx, layout)
    if into is None:
        out = jnp.zeros((layout.rows, layout.cols), values.dtype)
        out = out.at[row, col].set(values, unique_indices=True)
    else:
        v = values.astype(into.dtype)
        out = jnp.reshape(into, (layout.rows, layout.cols)).at[row, col].add(-v if sign < 0 else v,
                                                                           unique_indices=True)
    return jnp.reshape(out, layout.shape)


class CountDigits(NamedTuple):
    """How per-entry sender counts of up to ``n`` workers are packed, ``per`` entries to a float32 (static).

    Attributes:
      base: ``n + 1``: a count is a digit in ``[0, n]``.
      per: entries (consecutive columns of the matrix view) per float32, the largest with
        ``base**per <= 2**22``.
      workers: ``n``.
    """

    base: int
    per: int
    workers: int


def count_digits(workers: int) -> CountDigits:
    """The packing of sender counts for ``workers`` workers (:class:`CountDigits`).

    A packed float32 holds ``per`` counts as the base-``(n + 1)`` digits of an integer below ``2**22``:
    summing workers' packed indicators adds digit by digit without a carry (no digit passes ``n``), every
    partial sum is an exact float32, and the mean's division by ``n`` is undone exactly by rounding
    ``mean * n`` (the relative error of one float32 division, times an integer below ``2**22``, is
    below 1/2).  Two workers pack 13 counts per float32, 8 workers 6, 64 workers 3, 2047 workers 2, more than 2047 one.

    Examples:
      >>> count_digits(2), count_digits(8).per, count_digits(5000).per
      (CountDigits(base=3, per=13, workers=2), 6, 1)
    """
    base = int(workers) + 1
    per = 1
    while base ** (per + 1) <= 2**22:
        per += 1
    return CountDigits(base, per, int(workers))


def sent_digits(idx: jnp.ndarray, layout: ChunkLayout, digits: CountDigits) -> jnp.ndarray:
    """One worker's indicator of the entries it sent, packed: float32 ``(rows, ceil(cols / per))``.

    Entry ``(r, c)`` of the matrix view adds ``base**(c % per)`` to slot ``(r, c // per)``; the
    positions ``idx`` (``(tiles, k)``, distinct within a tile) are each sent once, so every digit is 0 or 1.
    Sums of these over workers are read back by :func:`count_senders`.
    """
    row, col = tile_positions(idx, layout)
    slots = -(-layout.cols // digits.per)
    weight = jnp.asarray(np.float32(digits.base) ** np.arange(digits.per, dtype=np.float32))
    out = jnp.zeros((layout.rows, slots), jnp.float32)
    return out.at[row, col // digits.per].add(weight[col % digits.per])


def count_senders(mean: jnp.ndarray, layout: ChunkLayout, digits: CountDigits) -> jnp.ndarray:
    """Per entry, the number of workers that sent it: int32 of ``layout.shape``.

    Args:
      mean: float32 ``(rows, ceil(cols / per))``: the mean over ``digits.workers`` workers of their
        :func:`sent_digits` (their sum divided by ``n``), or one worker's.
      layout: the tiles (:func:`chunk_layout`).
      digits: the packing (:func:`count_digits`).
    """
    total = jnp.round(mean * np.float32(digits.workers)).astype(jnp.int32)
    place = jnp.asarray(np.int32(digits.base) ** np.arange(digits.per, dtype=np.int32))
    c = (total[..., None] // place) % digits.base  # (rows, slots, per)
    c = jnp.reshape(c, (layout.rows, -1))[:, :layout.cols]
    return jnp.reshape(c, layout.shape)


def statistical_encode(v: jnp.ndarray, bits: int, range_sigmas: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """SparseLoCo's statistical quantizer (``TopKCompressor._quantize``) over a vector of kept values.

    Args:
      v: the values, any shape (raveled), float dtype.
      bits: code width; ``bins = 2**bits``.
      range_sigmas: the codes span ``range_sigmas`` standard deviations.

    Returns:
      ``(codes, params)``: uint32 ``(v.size,)`` codes in ``[0, bins)`` and float32 ``(1 + bins,)``:
      ``shift`` then the ``bins`` lookup values (see the module docstring).
    """
    bins = 2**bits
    v = jnp.ravel(v).astype(jnp.float32)
    n = v.shape[0]
    shift = jnp.mean(v)
    c = v - shift
    std = jnp.linalg.norm(c) / math.sqrt(n - 1) if n > 1 else jnp.float32(0)
    scale = range_sigmas * std / bins
    scale = jnp.where((scale == 0) | ~jnp.isfinite(scale), jnp.float32(1), scale)
    codes = jnp.clip(jnp.round(c / scale + bins // 2), 0, bins - 1).astype(jnp.int32)
    sums = jnp.zeros((bins,), jnp.float32).at[codes].add(c)
    counts = jnp.zeros((bins,), jnp.float32).at[codes].add(1.0)
    lookup = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
    return codes.astype(jnp.uint32), jnp.concatenate([shift[None], lookup])


def statistical_decode(codes: jnp.ndarray, params: jnp.ndarray) -> jnp.ndarray:
    """Inverse of :func:`statistical_encode`: float32 values ``lookup[code] + shift``, shape of ``codes``."""
    return params[1:][codes.astype(jnp.int32)] + params[0]
