"""Chunk-wise top-k whose kept values go through a quantizer and whose indices are packed chunk-locally.

The composed wire format of SparseLoCo (Sarfi et al. 2025) and DeMo (Peng et al. 2024): one compressor,
:func:`chunktopk`, that sparsifies (top-k per tile, optionally in the DCT domain), quantizes the kept
values (:mod:`compjax.codecs.chunked`) and packs the tile-local indices, with a decayed error-feedback
accumulator.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import collectives
from compjax._checks import check_range
from compjax.codecs import bitpack, ordering
from compjax.codecs import chunked as ck
from compjax.codecs import quantize as q
from compjax.collectives import AxisName
from compjax.compressors import error_feedback as ef
from compjax.compressors.base import Exchanged, compressor

__all__ = ["VALUE_FORMATS", "ChunktopkState", "chunktopk", "chunktopk_bytes"]

#: What the kept values may travel as: quantizers that take any vector of values, or a float dtype.
VALUE_FORMATS = ("statistical", "sign", "float32", "bfloat16", "float16")

#: compjax's other quantizers, and why they cannot take a sparsifier's kept values.
_NOT_FOR_VALUES = {
    "twobit": "its threshold is absolute (MXNet semantics): kept top-k values are all above any useful threshold",
    "onebit": "it needs the dense layer's columns for its reconstruction values",
    "terngrad": "its scaler is shared through a max over workers, a collective of its own",
    "qsgd": "it draws a random number per entry from a key this compressor does not hold",
    "e3m0": "it is a compressor of whole layers (a power-of-two scale per tensor), not a value codec here",
    "powersgd": "it is a low-rank compressor of matrices, not a value codec",
    "topk": "it is a sparsifier, not a quantizer",
    "randomk": "it is a sparsifier, not a quantizer",
    "dgc": "it is a sparsifier, not a quantizer",
}

_RAW = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ChunktopkState(NamedTuple):
    """State of :func:`chunktopk`.

    Attributes:
      accumulator: the (decayed) error-feedback memory ``e``, same tree, shapes and dtypes as the params
        (None when ``error_feedback=False``).
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step (:func:`chunktopk_bytes`, plus 4 for the
        non-finite vote); read it with :func:`compjax.payload_bytes`.
    """

    accumulator: Any
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def _check_values(values, value_bits) -> None:
    if values in _NOT_FOR_VALUES:
        raise ValueError(f"values={values!r} cannot quantize the kept values of a sparsifier: "
                         f"{_NOT_FOR_VALUES[values]}; values must be one of {VALUE_FORMATS}")
    if values not in VALUE_FORMATS:
        raise ValueError(f"values must be one of {VALUE_FORMATS}, got {values!r}")
    if values == "statistical":
        check_range("value_bits", value_bits, 1, 8, integer=True, static=True)


class _Plan(NamedTuple):
    """Static layout of one layer's part of the payload."""

    layout: ck.ChunkLayout
    k: int  # kept per tile
    ibits: int  # bits per tile-local index
    idx_words: int
    val_words: int
    floats: int  # float32 per layer (quantizer parameters)
    raw: int  # raw values


def _plan(shape, k, chunk, dct, values, value_bits) -> _Plan:
    layout = ck.chunk_layout(shape, chunk)
    kk = ck.chunk_k(layout, k, chunk, proportional=not dct)
    n = layout.tiles * kk
    ibits = ck.index_bits(layout.length)
    vbits = {"statistical": value_bits, "sign": 1}.get(values, 0)
    return _Plan(layout, kk, ibits, bitpack.num_words(n, ibits) if ibits else 0,
                 bitpack.num_words(n, vbits) if vbits else 0,
                 {"statistical": 1 + 2**value_bits if vbits else 0, "sign": 1}.get(values, 0),
                 n if values in _RAW else 0)


def chunktopk_bytes(shapes, k: int, *, chunk: int = 64, dct: bool = False, values: str = "statistical",
                    value_bits: int = 2) -> int:
    """Bytes one worker sends per step for layers of ``shapes`` (without the 4-byte non-finite vote).

    Per layer of ``T`` tiles of ``L`` entries keeping ``k_l`` per tile (``n = T k_l`` entries):
    ``4 ceil(n / floor(32 / b_i)) ...`` words of packed ``b_i = ceil(log2 L)``-bit indices (split into bit
    fields as :mod:`compjax.codecs.bitpack` does), words of packed ``value_bits``-bit codes and ``4 (1 +
    2**value_bits)`` bytes of quantizer parameters (``"statistical"``); 1-bit codes and 4 bytes
    (``"sign"``); or ``n`` values of 4 or 2 bytes.  For full 64 x 64 tiles with 2-bit values that is
    ``(12 + 2) / 8 = 1.75`` bytes per kept entry, against 8 for :func:`compjax.topk` (int32 index + float32).

    Examples:
      >>> chunktopk_bytes([(128, 128)], 128)   # 4 tiles x 128 entries: 512 x 12-bit indices + 512 x 2-bit codes
      916
    """
    total = 0
    for s in shapes:
        p = _plan(tuple(s), int(k), int(chunk), bool(dct), values, value_bits)
        total += 4 * (p.idx_words + p.val_words + p.floats) + p.raw * jnp.dtype(_RAW.get(values, jnp.float32)).itemsize
    return total


def chunktopk(
    k: int = 128,
    *,
    chunk: int = 64,
    dct: bool = False,
    values: str = "statistical",
    value_bits: int = 2,
    range_sigmas: float = 6.0,
    decay: float = 1.0,
    error_feedback: bool = True,
    aggregate: str = "mean",
    skip_nonfinite: bool = True,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Chunk-wise top-k, quantized kept values, packed tile-local indices, decayed error feedback.

    Per worker and layer (SparseLoCo, Sarfi et al. 2025, Algorithm 1; reference code tplr-ai/SparseLoCo
    ``src/tplr/sparseloco.py``, ``SparseLoCo.step`` and ``TopKCompressor``)::

        e ← β e + g                          (decayed error feedback; β = decay)
        T = tiles of e                        (h x w tiles, h, w ≤ chunk; DCT-II of each tile with dct=True)
        keep the k_l entries of largest |T| in every tile; Q = quantize(kept values)
        ê = the receiver's decoding of (indices, Q)      (values after quantization; inverse DCT)
        e ← e − ê
        output: the mean over workers of every worker's ê

    Tiles, the DCT and the quantizers are :mod:`compjax.codecs.chunked`'s.  ``k`` is given per full
    ``chunk x chunk`` tile; a smaller tile keeps ``max(1, round(L k / chunk**2))`` (the reference's
    scaling), or ``min(k, L)`` with ``dct=True`` (DeMo's ``CompressDCT._clamp_topk``).

    **Wire**: all layers' packed indices and codes in one uint32 buffer, the quantizers' parameters in
    one float32 buffer (raw values in a third), all-gathered (:func:`compjax.collectives.gathered_mean`):
    every worker decodes every worker's payload.  ``payload_bytes`` is :func:`chunktopk_bytes`: with
    64 x 64 tiles, 12-bit indices and 2-bit values, **1.75 bytes per kept entry** (plus 20 bytes per layer).

    **Sharded parameters** (a step with ``specs=``): the compressor works on this device's shard of each
    layer.  The tiles are the layer's, and a shard holds whole tiles when its edges fall on tile edges (cut
    along the columns into a multiple of the tile width, or along another dimension into blocks of rows
    that are multiples of the tile height: a stacked ``(layers, rows, cols)`` leaf cut along its rows
    qualifies when ``rows / fast`` is a multiple of the tile height); the host's payload lists every
    shard's kept entries in the layer's tile order (the replicated layout's packed indices and codes).  Only
    a layer whose shard edges cut through tiles is all-gathered over the fast axis and handled whole.
    **Memory** per layer: a tiled copy for the selection, and one dense float32 mean that every worker's
    kept entries are scattered into (no tiled decode, no dense copy of what was sent: the error feedback
    subtracts it at the kept entries); ``"senders"`` adds the count of senders of each entry, packed
    several entries to a float32 (:func:`compjax.codecs.chunked.count_digits`).

    **Aggregate**: ``"mean"`` averages the decoded sparse tensors over all ``n`` workers (the paper's
    ``Δ = (1/R) Σ_r Δ̂_r``; zeros where a worker sent nothing); ``"senders"`` averages each entry over the
    workers that sent it (the reference code's ``scatter_reduce(reduce="mean", include_self=False)`` in
    ``batch_decompress``, which DeMo's ``demo.py`` uses too).  The error feedback takes what this worker
    sent, as decoded.

    Args:
      k: entries kept per ``chunk x chunk`` tile, an integer in ``[1, chunk**2]`` (static).
      chunk: the target tile side, a positive integer (static): a tile is ``h x w`` with ``h`` and ``w``
        the largest divisors of the layer's rows and columns at most ``chunk``.
      dct: select in the tiles' orthonormal DCT-II domain (DeMo).
      values: how kept values travel: ``"statistical"`` (SparseLoCo's ``value_bits``-bit quantizer with a
        per-layer lookup table), ``"sign"`` (1 bit, one scale per layer), ``"float32"``, ``"bfloat16"`` or
        ``"float16"``.  compjax's other quantizers cannot take a sparsifier's values (ValueError says why).
      value_bits: bits per value of ``"statistical"``, an integer in [1, 8] (static; 2: four bins).
      range_sigmas: span of ``"statistical"``'s codes in standard deviations, positive (6 in the reference).
      decay: ``β`` of the accumulator, in [0, 1] (may be traced); 1 is plain error feedback.
      error_feedback: keep the accumulator (else each step sends from its own gradient alone).
      aggregate: ``"mean"`` or ``"senders"`` (see above).
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``; ``update`` takes local gradients and returns the
      aggregated decoded sparse tensors (same tree, shapes, dtypes).

    Raises:
      ValueError: ``chunk`` not a positive integer, ``k`` outside ``[1, chunk**2]``, ``decay`` outside
        [0, 1] (or not 1 without error feedback), ``values`` not one of :data:`VALUE_FORMATS` (a compjax
        quantizer that cannot take the kept values is named with the reason), ``value_bits`` outside
        [1, 8], ``range_sigmas <= 0``, ``aggregate`` unknown (build time); a gradient tree that does not
        match the state (trace time).

    References:
      Sarfi, Thérien, Lidin & Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
      arXiv 2508.15706, 2025 (Algorithm 1); code github.com/tplr-ai/SparseLoCo, ``src/tplr/sparseloco.py``
      (``ChunkingTransform``, ``TopKCompressor.compress``/``_quantize``/``batch_decompress``,
      ``SparseLoCo.step``).  Peng, Quesnelle & Kingma, "DeMo: Decoupled Momentum Optimization",
      arXiv 2411.19870, 2024; code github.com/bloc97/DeMo, ``demo.py``.

    Examples:
      >>> import jax.numpy as jnp, compjax as cj
      >>> tx = cj.chunktopk(2, chunk=4, values="float32")     # 2 of every 4 x 4 tile
      >>> g = {"w": jnp.arange(16.0).reshape(4, 4)}
      >>> out, state = tx.update(g, tx.init(g))
      >>> [float(x) for x in out["w"][3]]
      [0.0, 0.0, 14.0, 15.0]
      >>> int(cj.message_bytes(state))   # one worker, the message: 2 four-bit indices in one word + 2 float32
      12
    """
    check_range("chunk", chunk, 1, None, integer=True, static=True)
    chunk = int(chunk)
    check_range("k", k, 1, chunk * chunk, integer=True, static=True)
    k = int(k)
    _check_values(values, value_bits)
    value_bits = int(value_bits) if values == "statistical" else 0
    check_range("range_sigmas", range_sigmas, 0.0, None, lo_open=True)
    check_range("decay", decay, 0.0, 1.0)
    if not error_feedback and not hasattr(decay, "shape") and float(decay) != 1.0:
        raise ValueError(f"decay must be 1 without error feedback (nothing accumulates), got {decay!r}")
    if aggregate not in ("mean", "senders"):
        raise ValueError(f"aggregate must be 'mean' or 'senders', got {aggregate!r}")
    senders = aggregate == "senders"
    raw_dtype = _RAW.get(values)

    def init_fields(xs):
        return {"accumulator": [jnp.zeros_like(x) for x in xs] if error_feedback else None}

    def exchange(gs, fields, ctx):
        acc = fields["accumulator"]
        sh = ctx.shards
        gs, acc, cuts, gathered = _shard_tiling(gs, acc, sh, chunk)
        # Written once (ordering.settled): XLA fused β e + g into every pass that reads it (the tiling, the
        # residual's scatter), keeping g's inputs alive until the last (in DiLoCo, the parameters it overwrites).
        ps = ordering.settled(list(ef.accumulate(acc, gs, decay)), ctx.count) if acc is not None else list(gs)
        shapes = [p.shape if c is None else c.layer.shape for p, c in zip(ps, cuts)]
        plans = [_plan(shape, k, chunk, dct, values, value_bits) for shape in shapes]
        words, floats, raws = [], [], []
        for p, pl, cut in zip(ps, plans, cuts):
            lay = pl.layout if cut is None else cut.own
            t = ck.tile(p.astype(jnp.float32), lay)
            if dct:
                t = ck.dct_tiles(t, lay)
            idx, val = ck.topk_rows(collectives.rows_over_worker_devices(t, ctx.axis_name), pl.k)
            if cut is not None:  # the host's kept entries, in the layer's tile order: the layer's payload
                idx, val = cut.layer_order(idx), cut.layer_order(val)
            if pl.ibits:
                words.append(bitpack.pack(idx, pl.ibits))
            if values == "statistical":
                codes, prm = ck.statistical_encode(val, value_bits, range_sigmas)
                words.append(bitpack.pack(codes, value_bits))
                floats.append(prm)
            elif values == "sign":
                codes, scale = q.sign_encode(val)
                words.append(bitpack.pack(codes, 1))
                floats.append(scale)
            else:
                raws.append(jnp.ravel(val).astype(raw_dtype))
        cat = lambda parts, dtype: jnp.concatenate(parts) if parts else jnp.zeros((0,), dtype)
        payload = (cat(words, jnp.uint32), cat(floats, jnp.float32), cat(raws, raw_dtype or jnp.float32))

        def kept(w, f, r):
            """One worker's payload -> per layer ``(idx, val)``, ``(tiles, k)`` each, of this device's tiles."""
            out, wo, fo, ro = [], 0, 0, 0
            for pl, cut in zip(plans, cuts):
                n, shape = pl.layout.tiles * pl.k, (pl.layout.tiles, pl.k)
                if pl.ibits:
                    idx = bitpack.unpack(w[wo:wo + pl.idx_words], pl.ibits, n).astype(jnp.int32).reshape(shape)
                    wo += pl.idx_words
                else:
                    idx = jnp.zeros(shape, jnp.int32)
                if values == "statistical":
                    codes = bitpack.unpack(w[wo:wo + pl.val_words], value_bits, n)
                    val = ck.statistical_decode(codes, f[fo:fo + pl.floats])
                elif values == "sign":
                    codes = bitpack.unpack(w[wo:wo + pl.val_words], 1, n)
                    val = q.sign_decode(codes, f[fo:fo + 1], (n,))
                else:
                    val = r[ro:ro + n].astype(jnp.float32)
                wo, fo, ro = wo + pl.val_words, fo + pl.floats, ro + pl.raw
                val = val.reshape(shape)
                if cut is not None:  # decode this device's tiles only
                    idx, val = cut.own_tiles(idx), cut.own_tiles(val)
                out.append((idx, val))
            return out

        # "senders" without the DCT: each worker's indicator of what it sent travels through the mean packed,
        # several entries' counts to a float32 (exact integer digits), not as a dense float32 copy of the layer.
        digits = ck.count_digits(collectives.num_workers(ctx.axis_name)) if senders and not dct else None

        def decode(w, f, r):
            """One worker's payload -> per layer its dense values (and, for "senders", indicators).

            Without the DCT, straight into the layer's (this device's shard's) shape, the indicators packed
            (:func:`compjax.codecs.chunked.sent_digits`); with it, as (tiles, L) coefficients for the
            inverse DCT and (tiles, L) indicators.
            """
            out = []
            for pl, cut, (idx, val) in zip(plans, cuts, kept(w, f, r)):
                lay = pl.layout if cut is None else cut.own
                if dct:
                    out.append(ck.scatter_rows(idx, val, lay.length))
                    if senders:
                        out.append(ck.scatter_rows(idx, jnp.ones(idx.shape, jnp.float32), lay.length))
                else:
                    out.append(ck.scatter_layer(idx, val, lay))
                    if senders:
                        out.append(ck.sent_digits(idx, lay, digits))
            return out

        def finish(dense, like):
            """Per layer: combine (senders: values over indicators); with the DCT, inverse DCT and untile."""
            res = []
            for i, (pl, x, cut) in enumerate(zip(plans, like, cuts)):
                lay = pl.layout if cut is None else cut.own
                if senders:
                    s, c = dense[2 * i], dense[2 * i + 1]
                    if digits is not None:  # the mean of the indicators, as the dense form would give it
                        c = ck.count_senders(c, lay, digits).astype(jnp.float32) / np.float32(digits.workers)
                    t = jnp.where(c > 0, s / jnp.where(c > 0, c, 1.0), 0.0)
                else:
                    t = dense[i]
                if dct:
                    t = ck.untile(ck.idct_tiles(t, lay), lay)
                res.append(t.astype(x.dtype))
            return res

        means, nbytes = collectives.gathered_mean(payload, decode, ctx.axis_name)
        means = finish(means, ps)
        new = {}
        if acc is not None:
            if dct:  # what was sent, in the parameters' domain, is dense
                sent = means if ctx.axis_name is None else finish(decode(*payload), ps)
                new["accumulator"] = ef.remainder(ps, sent)
            else:  # e - sent at the kept entries only (a scatter into e; the entries are distinct)
                new["accumulator"] = [
                    ck.scatter_layer(idx, val, pl.layout if cut is None else cut.own, into=p, sign=-1.0)
                    for p, pl, cut, (idx, val) in zip(ps, plans, cuts, kept(*payload))]
        if gathered:  # leaves whose tiles cross their shards were gathered: keep this device's shards
            means = [sh.own(m, i) if i in gathered else m for i, m in enumerate(means)]
            if acc is not None:
                new["accumulator"] = [sh.own(e, i) if i in gathered else e for i, e in enumerate(new["accumulator"])]
        return Exchanged(means, None, new, nbytes)

    return compressor(
        ChunktopkState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, init_fields=init_fields,
        tree_fields=("accumulator",), on_shards=True,
    )


class _Cut(NamedTuple):
    """How a sharded layer's tiles fall into its shards: whole tiles in every shard (static, but for the position).

    The layer's tiles, in its row-major tile order, are ``(outer, fast, inner)``: device ``f`` of the fast
    axis holds ``[:, f, :]``, which is its shard's own tiles ``(outer, inner)`` in the shard's row-major tile
    order.  Cut along the columns (the last dimension): ``outer`` tile rows of ``inner`` tiles each; cut
    along another dimension ``d``: ``outer = prod(shape[:d])`` blocks of ``inner`` whole tiles each (one
    block of rows when ``d = 0``).
    """

    layer: ck.ChunkLayout  # the layer's tiles
    own: ck.ChunkLayout  # this device's shard cut with the layer's tile size
    outer: int  # blocks of the layer's tile order, each holding one run of ``inner`` tiles per shard
    axis: str  # the fast axis

    def _fast(self) -> int:
        return self.layer.tiles // self.own.tiles

    def layer_order(self, x: jnp.ndarray) -> jnp.ndarray:
        """``(tiles_own, ...)`` per-tile rows of every shard of the host -> ``(tiles, ...)`` in the layer's order."""
        g = collectives.gather_over_fast(x)  # (fast, tiles_own, ...)
        if self.outer == 1:
            return g.reshape((self.layer.tiles,) + x.shape[1:])
        g = g.reshape((self._fast(), self.outer, -1) + x.shape[1:])
        return jnp.swapaxes(g, 0, 1).reshape((self.layer.tiles,) + x.shape[1:])

    def own_tiles(self, x: jnp.ndarray) -> jnp.ndarray:
        """``(tiles, ...)`` rows of the layer's tiles -> this device's ``(tiles_own, ...)``."""
        f = jax.lax.axis_index(self.axis).astype(jnp.int32)
        g = x.reshape((self.outer, self._fast(), -1) + x.shape[1:])
        return jax.lax.dynamic_index_in_dim(g, f, axis=1, keepdims=False).reshape((self.own.tiles,) + x.shape[1:])


def _cut(layer: ck.ChunkLayout, shape: tuple, d: int, axis: str) -> _Cut | None:
    """The :class:`_Cut` of a layer whose shard of ``shape`` is cut along dimension ``d``, or None if tiles cross shards.

    Cut along the last dimension (the matrix view's columns; a vector's only
    one), each shard holds whole tiles when its columns are a multiple of the
    tile width.  Cut along another dimension ``d``, the shard's rows are
    ``prod(shape[:d])`` blocks of ``shape[d] * prod(shape[d + 1:-1])`` rows
    each (contiguous in the layer); each block holds whole tile rows when that
    is a multiple of the tile height.
    """
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    cols = shape[-1]
    if d == len(shape) - 1:
        if cols % layer.w:
            return None
        outer = layer.rows // layer.h
    else:
        block = math.prod(shape[d:-1])
        if block % layer.h:
            return None
        outer = math.prod(shape[:d])
    own = ck.ChunkLayout(shape, rows, cols, layer.h, layer.w, (rows // layer.h) * (cols // layer.w), layer.length)
    return _Cut(layer, own, outer, axis)


def _shard_tiling(gs, acc, sh, chunk):
    """Which shards hold whole tiles of their layer (a :class:`_Cut` each), the others gathered whole.

    A layer's shards hold whole tiles when each shard's part of the layer's
    matrix view is made of whole tiles (:func:`_cut`): cut along the columns
    into a multiple of the tile width, or along another dimension into blocks
    of rows that are multiples of the tile height.  The tiles are the layer's
    (their sides divide its rows and columns), so only a shard whose edge
    falls inside a tile needs its layer: such leaves (and their accumulator)
    are all-gathered over the fast axis here and handled whole.

    Returns:
      ``(gs, acc, cuts, gathered)``: the leaves and accumulator as the
      exchange uses them, one :class:`_Cut` or None (whole) per leaf, and the
      positions gathered.
    """
    cuts = [None] * len(gs)
    if sh is None:
        return list(gs), acc, cuts, set()
    gathered = set()
    gs, acc = list(gs), (list(acc) if acc is not None else None)
    for i, g in enumerate(gs):
        d = sh.dims[i]
        if d is None:
            continue
        layer = ck.chunk_layout(sh.whole_shape(g, i), chunk)
        cuts[i] = _cut(layer, tuple(int(n) for n in g.shape), d, sh.axis)
        if cuts[i] is None:
            gathered.add(i)
            gs[i] = collectives.gather_inside_host(g, sh.axis, d)
            if acc is not None:
                acc[i] = collectives.gather_inside_host(acc[i], sh.axis, d)
    return gs, acc, cuts, gathered
