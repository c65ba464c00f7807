"""Global-norm clipping that sees the whole model on every layout, and the chain checks around it.

A transformation whose math reduces over whole layers or the whole tree
(``optax.clip_by_global_norm``, LAMB/LARS trust ratios, Adafactor's factored
moments, Muon's orthogonalization, ...) gives another answer when it runs on
part of the data:

* **Before a compressor** it sees one worker's *local* gradient: clipping
  there clips each worker's gradient by its own norm (local gradient
  clipping, as DGC's ``clip_norm`` does on purpose), not the averaged
  gradient a one-device program clips.  :func:`local_norm_transforms` finds
  such a transform in a chain, and the step builders of
  :mod:`compjax.parallel` warn about it.
* **On sharded parameters** (``specs=``, a ``slow x fast`` mesh) every
  transformation of the chain runs on each device's *shard* of a layer; a
  global norm taken there is the shard's norm.  compjax's compressors gather
  what they need over the fast axis; optax's norm-based transforms cannot, so
  :func:`check_sharded_chain` refuses them, and :func:`clip_by_global_norm`
  here is the one that adds the shards' squared norms over the fast axis
  first.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives, layout
from compjax._checks import check_range
from compjax.compressors import chains

__all__ = [
    "ClipByGlobalNormState",
    "check_sharded_chain",
    "clip_by_global_norm",
    "local_norm_transforms",
    "warn_local_norms",
]


#: Factories (optax and its contrib) whose update reduces over whole leaves or the whole tree, so that
#: running on a shard or on one worker's gradient changes the result.  Matched on the ``__qualname__``
#: of the functions a transformation is made of (``"clip_by_global_norm.<locals>.update_fn"``).
NORM_TRANSFORMS = frozenset({
    "adaptive_grad_clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "normalize_by_update_norm",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "scale_by_distance_over_gradients",
    "scale_by_factored_rms",
    "scale_by_lbfgs",
    "scale_by_muon",
    "scale_by_novograd",
    "scale_by_param_block_norm",
    "scale_by_param_block_rms",
    "scale_by_polyak",
    "scale_by_sm3",
    "scale_by_trust_ratio",
})


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: none (``optax.EmptyState``'s shape, a NamedTuple of its own)."""


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` that takes the norm of whole layers on sharded parameters too.

    Scales the updates by ``max_norm / ||g||`` when the global norm
    ``||g|| = sqrt(sum over leaves of sum g**2)`` exceeds ``max_norm``, as
    optax does (gradient clipping, Pascanu et al., ICML 2013, Eq. 4).  Inside a
    sharded step of :mod:`compjax.parallel` (``specs=`` on a ``slow x fast``
    mesh) each device holds a shard of some leaves: their squared norms are
    added over the fast axis (one float32 ``psum`` inside the host, marked
    :func:`compjax.collectives.uncounted`), leaves every device holds whole are
    counted once, so every device scales by the same norm, that of the whole
    model.  Elsewhere it is ``optax.clip_by_global_norm`` exactly.

    Where to put it: after the compressor it clips the averaged gradient (what a
    one-device program clips); before it, each worker's local gradient.

    Args:
      max_norm: the largest global norm let through, > 0 (may be traced).

    Returns:
      ``optax.GradientTransformationExtraArgs`` with state :class:`ClipByGlobalNormState`.

    Raises:
      ValueError: ``max_norm`` not > 0; at trace time, a tree of another
        structure than the step's gradients under sharded parameters (e.g.
        inside ``optax.masked``).

    References:
      Pascanu, Mikolov & Bengio, "On the difficulty of training recurrent neural networks", ICML 2013.

    Examples:
      >>> import jax.numpy as jnp, compjax as cj
      >>> tx = cj.clip_by_global_norm(1.0)
      >>> g = {"w": jnp.array([3.0, 4.0])}
      >>> print(tx.update(g, tx.init(g))[0]["w"])
      [0.6 0.8]
    """
    check_range("max_norm", max_norm, 0, None, lo_open=True)

    def init_fn(params):
        del params
        return ClipByGlobalNormState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        leaves, treedef = jax.tree.flatten(updates)
        dims = layout.shard_dims_for(updates, "cj.clip_by_global_norm") or (None,) * len(leaves)
        whole = sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x, d in zip(leaves, dims) if d is None),
                    jnp.float32(0))
        parts = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x, d in zip(leaves, dims) if d is not None]
        norm = jnp.sqrt(whole + collectives.sum_over_fast(sum(parts))) if parts else jnp.sqrt(whole)
        clipped = [jax.lax.select(norm < max_norm, x, (x / norm.astype(x.dtype)) * max_norm) for x in leaves]
        return jax.tree.unflatten(treedef, clipped), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _norm_names(tx: Any) -> list[str]:
    return list(dict.fromkeys(chains.factory_name(f) for f in chains.parts(tx)
                              if chains.factory_name(f) in NORM_TRANSFORMS and not f.__module__.startswith("compjax")))


def check_sharded_chain(tx: optax.GradientTransformation) -> None:
    """Refuse a chain for sharded parameters that holds a transform which would see one shard's norm.

    Under ``specs=`` every transformation of the chain runs on each device's
    shard of the sharded layers; the transforms of :data:`NORM_TRANSFORMS`
    reduce over whole leaves or the whole tree and would silently use a
    shard's statistics (``optax.clip_by_global_norm`` would clip each shard by
    its own norm).  compjax's compressors and algorithms gather what they need;
    the transforms inside them (e.g. DiLoCo's inner optimizer) are checked too.

    Args:
      tx: the optimizer the sharded step will run.

    Raises:
      ValueError: naming each such transform and the fix (:func:`clip_by_global_norm`
        for clipping; a layout without ``specs=`` otherwise).
    """
    names = _norm_names(tx)
    if names:
        raise ValueError(
            f"tx holds {', '.join(f'optax.{n}' for n in names)}, which reduces over whole layers or the whole "
            "tree; with sharded parameters (specs=) it would run on each device's shard and use the shard's "
            "norm. Use cj.clip_by_global_norm(max_norm) for global-norm clipping (it adds the shards' norms "
            "over the fast axis), or train this optimizer with replicated parameters (no specs=)"
        )


def local_norm_transforms(tx: optax.GradientTransformation) -> list[str]:
    """The norm-based transforms of a chain that run before its first compjax compressor.

    Such a transform sees each worker's *local* gradient: ``optax.chain(
    optax.clip_by_global_norm(1.0), cj.topk(...), ...)`` clips every worker's
    gradient by its own norm, not the averaged gradient (put the clipping after
    the compressor for that); so does :func:`clip_by_global_norm` (which, on
    sharded parameters, takes the norm of a worker's whole local gradient).
    Transforms inside a compjax algorithm (DiLoCo's inner optimizer, which
    trains each worker alone by design) are not listed.

    Args:
      tx: an optax transformation, usually an ``optax.chain``.

    Returns:
      optax's factories by name (``["clip_by_global_norm"]``), compjax's with
      its prefix (``["cj.clip_by_global_norm"]``), empty when none.
    """
    names = []
    for fn in chains.parts(tx):
        if chains.is_exchange(fn):
            break
        if chains.factory_name(fn) in NORM_TRANSFORMS:
            if not fn.__module__.startswith("compjax"):
                names.append(chains.factory_name(fn))
            elif fn.__module__ == __name__:  # this module's clip_by_global_norm
                names.append("cj." + chains.factory_name(fn))
    return list(dict.fromkeys(names))


def warn_local_norms(tx: optax.GradientTransformation) -> None:
    """Warn (``UserWarning``) when a norm-based optax transform runs before the chain's compressor.

    Called by the step builders of :mod:`compjax.parallel` when they are built:
    ``optax.chain(optax.clip_by_global_norm(1.0), cj.topk(...), ...)`` clips
    each worker's local gradient by its own norm, which trains differently from
    the one-device program it was ported from (which clips the averaged
    gradient).  Local clipping on purpose (as DGC's ``clip_norm``) may silence
    it with ``warnings.filterwarnings("ignore", message=".*local gradient")``.

    Args:
      tx: the optimizer the step runs.
    """
    names = local_norm_transforms(tx)
    if names:
        warnings.warn(
            f"tx applies {', '.join(n if n.startswith('cj.') else f'optax.{n}' for n in names)} before its compjax "
            "compressor, so it sees each "
            "worker's local gradient (clipping there clips every worker's gradient by its own norm, not the "
            "averaged gradient a one-device program clips): put it after the compressor, e.g. "
            "optax.chain(cj.topk(...), optax.clip_by_global_norm(1.0), optax.adamw(...))",
            UserWarning,
            stacklevel=3,
        )
