"""Top-k sparsification with error feedback (Strom 2015; Aji & Heafield 2017)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax._checks import check_range, check_same_tree
from compjax.codecs.sparse import layer_k, topk_select
from compjax.collectives import AxisName
from compjax.compressors import error_feedback as ef
from compjax.compressors.sparsified import sparse_layers_mean


class TopkState(NamedTuple):
    """State of :func:`topk`.

    Attributes:
      residual: error-feedback memory, same tree/shapes/dtypes as the params
        (None when ``error_feedback=False``).
      payload_bytes: int32 scalar, bytes this worker put into collectives in the
        last step: ``sum_layers k * (4 + itemsize)`` (int32 indices + values).
    """

    residual: Any
    payload_bytes: jnp.ndarray


def topk(
    ratio: float, *, error_feedback: bool = True, axis_name: AxisName = None
) -> optax.GradientTransformationExtraArgs:
    """Top-k sparsified mean of local gradients, with residual error feedback.

    Per worker and layer (Aji & Heafield 2017, "gradient dropping"; Strom 2015)::

        p = g + e                        (error feedback on)
        send the k = max(1, ceil(ratio * size)) entries of largest |p|
        e = p - sent

    Every worker's int32 indices and values are exchanged with one bucketed
    all-gather each (:func:`compjax.collectives.sparse_mean`), scatter-added and
    divided by the number of workers.  Indices are flat offsets into the
    concatenation of all layers, so the step issues 2 collectives whatever the
    number of layers.

    Args:
      ratio: kept fraction per layer, in (0, 1].  ``ratio=1`` sends everything
        (equals :func:`identity` up to summation order).
      error_feedback: keep the unsent remainder and add it next step.
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``; ``update`` takes local gradients
      (pytree of float arrays) and returns the averaged sparse gradients, same
      structure, shapes and dtypes.

    Raises:
      ValueError: ``ratio`` outside (0, 1] (at build time); a gradient tree that
        does not match the residual's (at trace time).

    References:
      Strom, "Scalable distributed DNN training using commodity GPU cloud
      computing", Interspeech 2015.  Aji & Heafield, "Sparse communication for
      distributed gradient descent", EMNLP 2017.

    Examples:
      >>> import optax, compjax as cj
      >>> tx = optax.chain(cj.topk(0.01, axis_name="data"), optax.sgd(0.1, momentum=0.9))
    """
    check_range("ratio", ratio, 0.0, 1.0, lo_open=True)

    def init_fn(params):
        residual = ef.init_residual(params) if error_feedback else None
        return TopkState(residual=residual, payload_bytes=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        if error_feedback:
            check_same_tree(updates, state.residual, "residual")
        acc = ef.accumulate(state.residual, updates)
        leaves, treedef = jax.tree.flatten(acc)
        means, indices, nbytes = sparse_layers_mean(
            leaves, lambda i, x: topk_select(x, layer_k(x.size, ratio)), axis_name
        )
        residual = ef.remainder_sparse(acc, indices) if error_feedback else None
        return jax.tree.unflatten(treedef, means), TopkState(residual, jnp.asarray(nbytes, jnp.int32))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
