"""Exact top-k of integer scores through a threshold, without sorting the array.

``jax.lax.top_k`` over millions of entries costs tens of elementwise passes on
CPU, and compacting the entries above a threshold with a prefix sum over
millions of flags costs more still.  :func:`threshold_select` needs one pass
over the scores when its first threshold lands:

1. **flag words** -- one pass: the entries are taken in chunks of 256; word
   ``l`` (``0 <= l < 8``) of chunk ``c`` is a uint32 with bit ``j`` set where
   ``score[256 c + l + 8 j] >= thr`` (stride 8 inside the chunk: XLA:CPU packs
   these with vector instructions, ~4x faster than 32 consecutive entries); the
   count of candidates is the sum of the words' popcounts.  The threshold
   ``thr`` is moved (steps that double, then bisection) until
   ``k <= count <= capacity``, at most ``max_iters`` times (each try is one
   more pass);
2. **compaction** -- a prefix sum over the ``size / 32`` word counts; every
   non-empty word writes its index at its first candidate slot and a
   running maximum over the ``capacity`` slots gives each slot its word (no
   binary search); the slot's set bit is found by popcounts in its word: the
   ``count`` candidate indices (in word order, not increasing);
3. **exact k-th score among the candidates** -- bisection on the 32 bits of
   the score over the ``capacity`` candidates; the candidates above it and
   the lowest-index ones equal to it make the ``k`` (when more candidates tie
   with it than are needed, a second bisection, on the index, finds the cut:
   it runs only then).

When step 1 settles every entry of the top ``k`` is a candidate, so the
result **equals** exact top-k as a set, ties broken by the lowest index like
``jax.lax.top_k``.  When it does not settle (e.g. fewer than ``k`` positive
scores, or many equal ones), the selection falls back to ``jax.lax.top_k``
over all scores.  Shapes are static: always exactly ``k`` indices, in no
particular order.

Several layers are selected **together** (:func:`topk_many`): their threshold
moves share one loop (whose body usually never runs), their bisections one
loop and their fallbacks one branch, taken only when some layer did not
settle.  On XLA:CPU a loop or a branch per layer serializes the program;
without them the layers' kernels run side by side.

XLA:CPU notes: ``jax.lax.top_k`` of float32 runs a partial sort (custom call)
but of integers a full sort of the array, so samples and fallbacks on
magnitudes use float32; the magnitude flag pass compares the floats with the
threshold (``not -t < x < t``) so that no elementwise step depends on the
layer alone (XLA would hoist it out of the loop and write it as an array).
``jnp.cumsum`` lowers to a quadratic ``reduce_window`` there: prefix sums
here scan rows of 32 by doubling and recurse on the row totals.

Scores are uint32 and 0 means "never a candidate" (a threshold is >= 1); for
magnitudes, :func:`magnitude_scores` orders floats as integers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "BLOCK", "MIN_SAMPLE_HITS", "default_capacity", "magnitude_scores", "threshold_select", "topk", "topk_many",
    "worth_it",
]

#: Entries per flag word.
BLOCK = 32
#: Entries per chunk of flag words: word ``l`` of a chunk flags its entries ``l, l + LANES, ..., l + 31 LANES``.
CHUNK = 256
LANES = CHUNK // BLOCK


def n_words(size: int) -> int:
    """Flag words of a layer of ``size`` entries (whole chunks: ``8 ceil(size / 256)``)."""
    return -(-size // CHUNK) * LANES


def _pack(flags: jnp.ndarray, nb: int) -> jnp.ndarray:
    """uint32 ``(nb,)`` flag words (see the module docstring) of a bool ``(size,)`` vector, padded with False."""
    f = jnp.pad(flags, (0, nb * BLOCK - flags.shape[0])).reshape(nb // LANES, BLOCK, LANES).astype(jnp.uint32)
    bits = jnp.arange(BLOCK, dtype=jnp.uint32)[None, :, None]
    return jnp.sum(f << bits, axis=1, dtype=jnp.uint32).reshape(nb)  # disjoint bits: the sum is an OR


def _entry(word: jnp.ndarray, bit: jnp.ndarray) -> jnp.ndarray:
    """Entry index (int32) of bit ``bit`` of flag word ``word``."""
    return (word // LANES) * CHUNK + word % LANES + LANES * bit


def magnitude_scores(x: jnp.ndarray) -> jnp.ndarray:
    """uint32 scores ordered like ``|x|`` (the float's bits with the sign cleared): same shape as ``x``.

    For IEEE floats of 16 or 32 bits the magnitude's bit pattern orders like
    the magnitude; float16/bfloat16 are widened to float32 first (exactly).
    NaN scores above infinity.
    """
    x = x.astype(jnp.float32) if jnp.dtype(x.dtype).itemsize < 4 else x
    if jnp.dtype(x.dtype).itemsize != 4:
        x = x.astype(jnp.float32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7FFFFFFF)


def default_capacity(k: int) -> int:
    """Candidates kept: ``ceil(1.5 k) + 64``."""
    return math.ceil(1.5 * k) + 64


def worth_it(size: int, k: int) -> bool:
    """Whether :func:`threshold_select` can beat ``jax.lax.top_k``: layers of at least 8,192 entries,
    and ``capacity`` at most a quarter of them."""
    return size >= 8192 and default_capacity(k) * 4 <= size


def _words(scores: jnp.ndarray, thr: jnp.ndarray, nb: int) -> jnp.ndarray:
    """uint32 ``(nb,)`` flag words of ``scores >= thr``."""
    return _pack(scores >= thr, nb)


def _cumsum(x: jnp.ndarray, width: int = 32) -> jnp.ndarray:
    """Inclusive prefix sum of an int32 vector: rows of ``width`` scanned by doubling shifts, then row offsets.

    Equal to ``jnp.cumsum`` (integers); ~2x faster on XLA:CPU for 10^5 entries.
    """
    n = x.shape[0]
    if n <= 4 * width:
        return jnp.cumsum(x)
    rows = -(-n // width)
    m = jnp.pad(x, (0, rows * width - n)).reshape(rows, width)
    shift = 1
    while shift < width:
        m = m + jnp.pad(m, ((0, 0), (shift, 0)))[:, :width]
        shift *= 2
    ends = m[:, -1]
    return (m + (_cumsum(ends, width) - ends)[:, None]).reshape(-1)[:n]


def _magnitude_words(x: jnp.ndarray, thr: jnp.ndarray, *, nb: int) -> jnp.ndarray:
    """Flag words (like :func:`_words`) of a set ``F`` that holds ``{magnitude_scores(x) >= thr}``, ``x`` flat float.

    ``F = {i : not (-t < x[i] < t)}`` for the float ``t`` whose bits are ``thr``:
    two comparisons of ``x`` with a scalar, so that no step of the pass
    depends on ``x`` alone (XLA would hoist it out of the threshold loop and
    write it as one more array).  ``F`` equals ``{score >= thr}`` for
    ``thr <= 0x7F800000`` (NaNs score above infinity and are always in ``F``);
    it is always upward closed in the scores (with every entry it holds every
    larger or equal score) and contains that set, which is all the selection
    needs: when ``k <= |F|`` every entry of the top ``k`` is in ``F``.
    """
    x = x.astype(jnp.float32) if jnp.dtype(x.dtype).itemsize != 4 else x
    t = jax.lax.bitcast_convert_type(jnp.minimum(thr, jnp.uint32(0x7F800000)), jnp.float32)
    return _pack(~((x < t) & (x > -t)), nb)


def _count(words: jnp.ndarray) -> jnp.ndarray:
    return jnp.sum(jax.lax.population_count(words).astype(jnp.int32))


def _nth_set_bit(w: jnp.ndarray, j: jnp.ndarray) -> jnp.ndarray:
    """Position (int32) of the ``j``-th (0-based) set bit of each uint32 word ``w`` (``j < popcount(w)``)."""
    pos = jnp.zeros(w.shape, jnp.int32)
    for width in (16, 8, 4, 2, 1):
        low = jax.lax.population_count(w & jnp.uint32((1 << width) - 1)).astype(jnp.int32)
        go = j >= low
        w = jnp.where(go, w >> jnp.uint32(width), w)
        j = jnp.where(go, j - low, j)
        pos = pos + jnp.where(go, width, 0)
    return pos


def _exact(scores: jnp.ndarray, k: int) -> jnp.ndarray:
    """Indices of the k largest uint32 scores by ``jax.lax.top_k`` (ties: lowest index first), int32 ``(k,)``."""
    signed = jax.lax.bitcast_convert_type(scores ^ jnp.uint32(0x80000000), jnp.int32)  # keeps the order
    return jax.lax.top_k(signed, k)[1].astype(jnp.int32)


def _cummax(x: jnp.ndarray, width: int = 32) -> jnp.ndarray:
    """Inclusive running maximum of a non-negative int32 vector (the row-doubling scheme of :func:`_cumsum`)."""
    n = x.shape[0]
    if n <= 4 * width:
        return jax.lax.cummax(x)
    rows = -(-n // width)
    m = jnp.pad(x, (0, rows * width - n)).reshape(rows, width)
    shift = 1
    while shift < width:
        m = jnp.maximum(m, jnp.pad(m, ((0, 0), (shift, 0)))[:, :width])
        shift *= 2
    ends = _cummax(m[:, -1], width)
    before = jnp.pad(ends[:-1], (1, 0))
    return jnp.maximum(m, before[:, None]).reshape(-1)[:n]


class _Layer(NamedTuple):
    """One layer's threshold selection: how to flag, score and (as a fallback) select it exactly."""

    words_at: Callable[[jnp.ndarray], jnp.ndarray]  # thr -> uint32 (nb,) flag words of a set holding {score >= thr}
    score_at: Callable[[jnp.ndarray], jnp.ndarray]  # int32 indices -> uint32 scores
    exact: Callable[[], jnp.ndarray]  # () -> int32 (k,) exact top-k
    size: int
    k: int
    thr0: jnp.ndarray
    step0: float
    cap: int
    max_iters: int


def _select_many(layers: list[_Layer]) -> list[tuple[jnp.ndarray, jnp.ndarray]]:
    """:func:`threshold_select` of several layers at once: ``[(indices, settled), ...]``.

    The layers share their control flow, so that XLA sees one program of
    independent per-layer kernels (which it runs side by side) instead of a
    loop and a branch per layer: one threshold loop whose body moves the
    threshold of the layers that have not settled (none, usually: the loop
    body does not run), one bisection loop over all the layers' candidates, and
    one branch for the exact fallback, taken only if some layer did not settle.
    """
    if not layers:
        return []

    def outside(c, lay):
        return (c < lay.k) | (c > lay.cap)

    def live(carry, lay):
        return outside(carry[5], lay) & (carry[6] < lay.max_iters)

    def adjust(lay, carry):
        thr, lo, hi, step, _, c, it = carry  # lo: highest thr with > cap candidates; hi: lowest with < k
        too_low = c > lay.cap
        lo = jnp.where(too_low, jnp.maximum(lo, thr), lo)
        hi = jnp.where(too_low, hi, jnp.minimum(hi, thr))
        bracketed = (lo > 0) & (hi < jnp.uint32(0xFFFFFFFF))
        up = jnp.minimum(thr.astype(jnp.float32) + step, 4294967040.0).astype(jnp.uint32)
        down = jnp.maximum(thr.astype(jnp.float32) - step, 1.0).astype(jnp.uint32)
        guess = jnp.where(too_low, up, down)
        mid = lo + (hi - lo) // jnp.uint32(2)
        thr = jnp.where(bracketed, mid, guess)
        w = lay.words_at(thr)
        return thr, lo, hi, step * 2, w, _count(w), it + 1

    inits = []
    for lay in layers:
        thr0 = jnp.maximum(jnp.asarray(lay.thr0, jnp.uint32), jnp.uint32(1))
        w0 = lay.words_at(thr0)
        c0 = _count(w0)
        # Every carry derived from both thr0 and the count, so that it has their varying axes under shard_map.
        z = c0.astype(jnp.uint32) * jnp.uint32(0) + thr0 * jnp.uint32(0)
        inits.append((thr0 + z, z, z + jnp.uint32(0xFFFFFFFF), z.astype(jnp.float32) + lay.step0, w0,
                      c0 + z.astype(jnp.int32), z.astype(jnp.int32)))

    def any_live(carries):
        return jnp.any(jnp.stack([live(cr, lay) for cr, lay in zip(carries, layers)]))

    def move(carries):  # one more pass over the layers that have not settled
        return tuple(jax.lax.cond(live(cr, lay), partial(adjust, lay), lambda cr: cr, cr)
                     for cr, lay in zip(carries, layers))

    carries = jax.lax.while_loop(any_live, move, tuple(inits))
    settled = [~outside(cr[5], lay) for cr, lay in zip(carries, layers)]

    # Candidates: the entries flagged by the last words (garbage, but in range, where a layer did not settle).
    cands, idxs = [], []
    for cr, lay in zip(carries, layers):
        words, c = cr[4], cr[5]
        nb = words.shape[0]
        counts = jax.lax.population_count(words).astype(jnp.int32)
        start = _cumsum(counts) - counts  # first slot of each block's candidates
        slots = jnp.arange(lay.cap, dtype=jnp.int32)
        # Each non-empty block writes its index at its first slot (distinct slots < c), then a running
        # maximum gives every slot its block: no binary search over the blocks.
        owner = jnp.zeros((lay.cap,), jnp.int32).at[jnp.where(counts > 0, start, lay.cap)].set(
            jnp.arange(nb, dtype=jnp.int32), mode="drop")
        blk = jnp.minimum(_cummax(owner), nb - 1)
        j = slots - start[blk]
        valid = (slots < c) & (j < counts[blk])
        idx = _entry(blk, _nth_set_bit(words[blk], jnp.where(valid, j, 0)))
        idx = jnp.where(valid, jnp.minimum(idx, lay.size - 1), 0)
        cands.append(jnp.where(valid, lay.score_at(idx), jnp.uint32(0)))
        idxs.append(idx)

    def bit(b, kths):  # the k-th largest candidate score of every layer, one bit at a time
        one = jnp.uint32(1) << (jnp.uint32(31) - b.astype(jnp.uint32))
        return tuple(jnp.where(jnp.sum(cand >= (v | one), dtype=jnp.int32) >= lay.k, v | one, v)
                     for cand, v, lay in zip(cands, kths, layers))

    kths = jax.lax.fori_loop(0, 32, bit, tuple(cand[0] & jnp.uint32(0) for cand in cands))  # typed like cand

    # Ties with the k-th score: lax.top_k keeps the lowest indices, so the cut among the equal candidates is
    # the need-th smallest index (bisection on the 31 index bits), for all layers at once, and only when
    # some layer holds more ties than it needs (candidates come in word order, not index order).
    aboves = [cand > kth for cand, kth in zip(cands, kths)]
    equals = [cand == kth for cand, kth in zip(cands, kths)]
    needs = [lay.k - jnp.sum(a, dtype=jnp.int32) for a, lay in zip(aboves, layers)]
    excess = [jnp.sum(e, dtype=jnp.int32) > n for e, n in zip(equals, needs)]
    everything = tuple(idx[0] * 0 + jnp.int32(2**31 - 1) for idx in idxs)  # typed like the indices

    def cut(_):
        def bit(b, vs):  # the largest v with fewer than `need` equal candidates below it: the need-th index
            one = jnp.int32(1) << (jnp.int32(30) - b)
            return tuple(jnp.where(jnp.sum(e & (idx < (v | one)), dtype=jnp.int32) < n, v | one, v)
                         for e, idx, v, n in zip(equals, idxs, vs, needs))

        vs = jax.lax.fori_loop(0, 31, bit, tuple(idx[0] * 0 for idx in idxs))
        return tuple(jnp.where(x, v, a) for x, v, a in zip(excess, vs, everything))

    cuts = jax.lax.cond(jnp.any(jnp.stack(excess)), cut, lambda _: everything, None)
    picked = []
    for above, equal, idx, c, lay in zip(aboves, equals, idxs, cuts, layers):
        k = lay.k
        take = above | (equal & (idx <= c))  # exactly k
        pos = _cumsum(take.astype(jnp.int32)) - 1
        picked.append(jnp.zeros((k,), jnp.int32).at[jnp.where(take, pos, k)].set(idx, mode="drop"))

    def fallback(picked):  # some layer did not settle: exact top-k there
        return tuple(jax.lax.cond(s, lambda i: i, lambda i, lay=lay: lay.exact(), i)
                     for s, i, lay in zip(settled, picked, layers))

    everywhere = jnp.all(jnp.stack(settled))
    picked = jax.lax.cond(everywhere, lambda p: p, fallback, tuple(picked))
    return list(zip(picked, settled))


def threshold_select(
    scores: jnp.ndarray,
    score_at: Callable[[jnp.ndarray], jnp.ndarray],
    k: int,
    thr0: jnp.ndarray,
    step0: int,
    *,
    capacity: int | None = None,
    max_iters: int = 32,
    return_settled: bool = False,
):
    """Indices of the ``k`` largest uint32 scores, found through a threshold (see the module docstring).

    Args:
      scores: uint32 ``(size,)`` scores (an expression XLA can fuse into the
        passes over it, e.g. :func:`magnitude_scores` of the layer).
      score_at: ``score_at(int32 indices) -> uint32 scores`` at those indices
        (equal to ``scores[indices]``, without materializing ``scores``).
      k: static number of entries, ``1 <= k <= size``.
      thr0: uint32 scalar, the first threshold (e.g. from a sample); raised to 1 if 0.
      step0: the first step (in score units) by which the threshold moves
        before a bracket is found; it doubles at every try.
      capacity: static number of candidates kept (default :func:`default_capacity`).
      max_iters: threshold moves before falling back to exact top-k.
      return_settled: also return the bool scalar ``settled`` (False: the fallback ran).

    Returns:
      int32 ``(k,)`` indices, in no particular order; with
      ``return_settled``, ``(indices, settled)``.

    Raises:
      ValueError: ``k`` outside ``[1, size]`` or ``capacity < k``.
    """
    size = int(scores.shape[0])
    cap = _check_k(size, k, capacity)
    nb = n_words(size)
    [(idx, settled)] = _select_many([_Layer(lambda thr: _words(scores, thr, nb), score_at, lambda: _exact(scores, k),
                                            size, k, thr0, step0, cap, max_iters)])
    return (idx, settled) if return_settled else idx


def _check_k(size: int, k: int, capacity: int | None) -> int:
    """Validate ``k`` and ``capacity``; the capacity used (at most ``size``)."""
    if not 1 <= k <= size:
        raise ValueError(f"k must be in [1, {size}], got {k}")
    cap = default_capacity(k) if capacity is None else int(capacity)
    if cap < k:
        raise ValueError(f"capacity must be >= k = {k}, got {cap}")
    return min(cap, size)


#: Fewest sample entries expected above the first threshold: the sample then places it within about
#: ``+-2/sqrt(64) = 25%`` of the target count, inside the window ``[k, capacity]`` (one pass, usually).
MIN_SAMPLE_HITS = 64


def topk(x: jnp.ndarray, k: int, *, sample_ratio: float = 0.01, start=None, return_settled: bool = False):
    """The ``k`` entries of largest magnitude of ``x``: :func:`threshold_select` on :func:`magnitude_scores`.

    One layer of :func:`topk_many` (see there).

    Args:
      x: array of any shape, float dtype.
      k: static number of entries, ``1 <= k <= x.size``.
      sample_ratio: fraction of entries sampled, in (0, 1] (see :func:`topk_many`).
      start: int32 scalar offset of the strided sample (e.g. random, as DGC);
        None: the middle of the first stride.
      return_settled: also return whether the threshold settled (bool scalar).

    Returns:
      ``(indices, values)``: int32 ``(k,)`` flat indices into ``x.ravel()``
      (in no particular order) and ``x.ravel()[indices]`` (``x.dtype``); with
      ``return_settled``, ``(indices, values, settled)``.

    Raises:
      ValueError: ``k`` outside ``[1, x.size]``.
    """
    return topk_many([x], [k], sample_ratio=sample_ratio, starts=None if start is None else [start],
                     return_settled=return_settled)[0]


def topk_many(
    xs: Sequence[jnp.ndarray],
    ks: Sequence[int],
    *,
    sample_ratio: float = 0.01,
    starts: Sequence | None = None,
    return_settled: bool = False,
) -> list[tuple]:
    """The ``k_i`` entries of largest magnitude of every layer ``x_i``, exact whenever the threshold settles.

    Per layer, :func:`threshold_select` on :func:`magnitude_scores`, all layers
    at once (one threshold loop, one bisection loop and one fallback branch for
    all of them: XLA runs the layers' kernels side by side).  The first
    threshold is the score that a ``(k + capacity) / 2``-th of a strided sample
    of ``|x|`` reaches (DGC's sampled threshold, Lin et al. 2018, Sec. 3.2): a
    fraction ``sample_ratio`` of the layer, at least ``2 size / k`` entries and
    enough for :data:`MIN_SAMPLE_HITS` of them to be expected above it, so
    that the first pass usually settles.  The flag passes compare the layer
    with the threshold as floats (no array of scores is written).  The result
    equals exact top-k (``jax.lax.top_k`` of ``|x|``, ties to the lowest index)
    whenever the threshold settles (see the module docstring); layers where it
    cannot pay off (:func:`worth_it`) use ``jax.lax.top_k`` directly.

    Args:
      xs: arrays of any shapes, float dtypes.
      ks: static number of entries per layer, ``1 <= k_i <= x_i.size``.
      sample_ratio: fraction of entries sampled, in (0, 1].
      starts: per layer, an int32 scalar offset of the strided sample (taken
        modulo the stride; e.g. random, as DGC), or None: the middle of the first stride.
      return_settled: also return whether each threshold settled (bool scalar;
        False for the layers that use ``jax.lax.top_k`` directly).

    Returns:
      One ``(indices, values)`` per layer: int32 ``(k_i,)`` flat indices into
      ``x_i.ravel()`` (in no particular order) and ``x_i.ravel()[indices]``
      (``x_i.dtype``); with ``return_settled``, ``(indices, values, settled)``.

    Raises:
      ValueError: a ``k_i`` outside ``[1, x_i.size]``, or ``xs`` and ``ks`` (or ``starts``) of different lengths.
    """
    from compjax.codecs.threshold import sample_size

    if len(xs) != len(ks) or (starts is not None and len(starts) != len(xs)):
        raise ValueError(f"one k (and start) per layer: {len(xs)} layers, {len(ks)} ks")
    flats = [jnp.ravel(x) for x in xs]
    out: list = [None] * len(flats)
    layers, where = [], []
    for i, (flat, k) in enumerate(zip(flats, ks)):
        size = int(flat.size)
        if not 1 <= k <= size:
            raise ValueError(f"k must be in [1, {size}], got {k}")
        if not worth_it(size, k):
            if k == size:
                idx = jnp.arange(size, dtype=jnp.int32)
            else:
                idx = jax.lax.top_k(jnp.abs(flat), k)[1].astype(jnp.int32)
            out[i] = (idx, jnp.zeros((), bool))
            continue
        cap = default_capacity(k)
        target = (k + cap) / 2
        n_s = min(size, max(sample_size(size, k, sample_ratio), math.ceil(MIN_SAMPLE_HITS * size / target)))
        stride = size // n_s
        start = starts[i] if starts is not None else None
        start = stride // 2 if start is None else jnp.asarray(start, jnp.int32) % stride
        sample = jnp.abs(flat[start + jnp.arange(n_s, dtype=jnp.int32) * stride].astype(jnp.float32))
        k_s = max(1, round(n_s * target / size))
        # min of the top-k_s (indexing [-1] instead makes XLA sort the whole sample); on float32, as XLA:CPU's
        # TopK runs a partial sort there but a full sort of integers.
        thr0 = magnitude_scores(jnp.min(jax.lax.top_k(sample, k_s)[0]))
        nb = n_words(size)
        layers.append(_Layer(
            partial(_magnitude_words, flat, nb=nb),  # from the layer in every pass: no array of scores
            lambda i, flat=flat: magnitude_scores(flat[i]),
            partial(_exact_magnitude, flat, k),
            size, k, thr0, 2.0**20, cap, 32,
        ))
        where.append(i)
    for i, res in zip(where, _select_many(layers)):
        out[i] = res
    return [(idx, flat[idx], settled) if return_settled else (idx, flat[idx])
            for (idx, settled), flat in zip(out, flats)]


def _exact_magnitude(flat: jnp.ndarray, k: int) -> jnp.ndarray:
    """Indices of the k largest ``|flat|`` by ``jax.lax.top_k`` on float32 (XLA:CPU's partial sort), int32 ``(k,)``."""
    return jax.lax.top_k(jnp.abs(flat.astype(jnp.float32)), k)[1].astype(jnp.int32)
