"""Random-k sparsification, with error feedback or unbiased scaling (Stich, Cordonnier & Jaggi 2018)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives
from compjax._checks import check_range
from compjax.codecs import permutation
from compjax.codecs.sparse import layer_k
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.error_feedback import SentAt
from compjax.compressors.keys import as_key, step_stream
from compjax.compressors.sparsified import sparse_layers_mean


class RandomkState(NamedTuple):
    """State of :func:`randomk`.

    Attributes:
      residual: error-feedback memory, same tree as the params (None when
        ``error_feedback=False``).
      key: uint32 ``(2,)`` PRNG key, the same on every worker (steps and workers enter its stream).
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step:
        ``sum_layers k * (4 + itemsize)`` + 4 (the non-finite vote).
    """

    residual: Any
    key: jax.Array
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def randomk(
    ratio: float,
    *,
    key,
    error_feedback: bool = True,
    skip_nonfinite: bool = True,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """Random-k sparsified mean of local gradients.

    Per worker and layer of ``d`` entries, with ``k = max(1, ceil(ratio * d))``
    entries drawn without replacement, independently on every worker and step:
    the images of ``0, ..., k - 1`` under a keyed pseudo-random permutation of
    the layer's indices (a Feistel network on the counter-based stream
    ``stream(key, step, worker)`` of :mod:`compjax.codecs.random`, keyed by the
    layer's position among the compressed leaves;
    :func:`compjax.codecs.permutation.subsets`).  Every entry is kept with
    probability ``k / d``; the draw costs ``O(k)``, no pass over the layer::

        error_feedback=True  (Stich et al. 2018, "Sparsified SGD with memory"):
            p = g + e;  send p at the k entries;  e = p - sent
        error_feedback=False (unbiased):
            send (d / k) * g at the k entries, so E[sent] = g

    Indices and values travel like :func:`topk`'s (one int32 and one value
    all-gather for all layers, scatter-add, divide by the number of workers).

    Args:
      ratio: kept fraction per layer, in (0, 1]; fixes shapes (``static_args``
        of ``optax.inject_hyperparams``).
      key: int seed, typed key (``jax.random.key``) or raw uint32 key
        (``jax.random.PRNGKey``), the same on every worker.
      error_feedback: keep the unsent remainder (else scale by ``d / k``: unbiased).
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``; ``update`` takes local gradients
      and returns the averaged sparse gradients (same tree, shapes, dtypes).

    Raises:
      ValueError: ``ratio`` outside (0, 1] or a ``key`` that is not a seed or PRNG
        key (build time); a gradient tree that does not match the state (trace time).

    References:
      Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018.
      Wangni, Wang, Liu & Zhang, "Gradient Sparsification for
      Communication-Efficient Distributed Optimization", NeurIPS 2018 (unbiased scaling).

    Examples:
      >>> import optax, compjax as cj
      >>> tx = optax.chain(cj.randomk(0.01, key=0, axis_name="data"), optax.sgd(0.1, momentum=0.9))
    """
    check_range("ratio", ratio, 0.0, 1.0, lo_open=True, static=True)
    ratio = float(ratio)
    key0 = as_key(key)

    def exchange(ps, fields, ctx):
        st = step_stream(fields["key"], ctx.count, ctx.axis_name)
        sh = ctx.shards
        sizes = [int(x.size) if sh is None else math.prod(sh.whole_shape(x, i)) for i, x in enumerate(ps)]

        def choose_all(xs):
            ks = [layer_k(n, ratio) for n in sizes]
            out = []
            for i, (idx, x, k, n) in enumerate(zip(permutation.subsets(st, sizes, ks), xs, ks, sizes)):
                if sh is None or sh.dims[i] is None:
                    val = jnp.ravel(x)[idx]
                else:  # the layer's entries: each from the shard that holds it (zeros from the others), added
                    at = sh.to_shard(idx, x.shape, i)
                    mine = jnp.ravel(x).at[at].get(mode="fill", fill_value=0)
                    val = collectives.sum_over_fast(mine)
                out.append((idx, val if error_feedback else val * jnp.asarray(n / k, val.dtype)))
            return out

        pairs = choose_all(ps)
        means, indices, nbytes = sparse_layers_mean(ps, None, ctx.axis_name, select_all=lambda _: pairs, skip=ctx.skip,
                                                    shards=sh)
        if error_feedback:
            return Exchanged(means, SentAt(indices), {}, nbytes)
        # Scaled by d / k: what was sent is no longer p at those entries, so say it densely.
        sent = [jnp.zeros(p.size, p.dtype).at[i].set(v.astype(p.dtype), mode="drop").reshape(p.shape)
                for p, i, (_, v) in zip(ps, indices, pairs)]
        return Exchanged(means, sent, {}, nbytes)

    return compressor(
        RandomkState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, error_feedback=error_feedback,
        honours_skip=True, on_shards=True,
        init_fields=lambda xs: {"key": jnp.array(key0)},
    )
