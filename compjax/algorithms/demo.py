"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle & Kingma, 2024)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax._checks import check_range
from compjax.collectives import AxisName
from compjax.compressors.base import is_compressible
from compjax.compressors.chunktopk import ChunktopkState, chunktopk

__all__ = ["DemoState", "demo"]


class DemoState(NamedTuple):
    """State of :func:`demo`.

    Attributes:
      momentum: DeMo's ``delta``: the decayed momentum not sent yet, same tree, shapes and dtypes as the params.
      count: int32 scalar, updates applied (the learning-rate schedule's clock).
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step (:func:`compjax.chunktopk_bytes` with
        ``dct=True`` and the values' format, plus 4 for the non-finite vote).
    """

    momentum: Any
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def demo(
    learning_rate: float | optax.Schedule,
    *,
    decay: float = 0.999,
    k: int = 32,
    chunk: int = 64,
    weight_decay: float = 0.0,
    values: str = "float32",
    skip_nonfinite: bool = True,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    r"""DeMo as an optax transformation: DCT top-k of the momentum exchanged, sign update.

    Per worker, parameter and step, with ``η`` the learning rate (bloc97/DeMo ``demo.py``, ``DeMo.step``)::

        δ ← β δ + η g                                   (the momentum accumulates the gradient)
        C = DCT-II (orthonormal) of every tile of δ     (tiles of at most chunk x chunk, TransformDCT.encode)
        keep the k coefficients of largest |C| per tile (CompressDCT.compress)
        δ ← δ − IDCT(kept)                              (what is sent leaves the momentum)
        a = IDCT(per coefficient, the mean over the workers that sent it)   (batch_decompress, all-gather)
        θ ← θ (1 − η λ) − η sign(a)                     (decoupled weight decay, sign-SGD)

    ``update`` returns ``−η (sign(a) + λ θ)``: use it alone, or chain it only with transformations that
    keep updates (``optax.apply_updates`` moves the parameters).  The exchange is
    :func:`compjax.chunktopk` with ``dct=True``, ``decay=β``, ``aggregate="senders"``: all-gather of the
    packed tile-local indices (12 bits for 64 x 64 tiles, where the reference sends int64) and of the
    values (``values``: float32 as the reference, or a quantizer).  The reference applies this to each
    parameter of at most two dimensions; here a leaf of higher rank is viewed as
    ``(prod(shape[:-1]), shape[-1])`` and a scalar as ``(1, 1)``.  On a step skipped by the non-finite
    guard the update is zero (weight decay included) and the momentum is kept.

    Args:
      learning_rate: ``η``, a positive number or an optax schedule of the update count.
      decay: ``β`` of the momentum, in [0, 1) (0.999 in the reference).
      k: coefficients kept per tile, an integer in ``[1, chunk**2]`` (clamped to a smaller tile's size;
        32 in the reference).
      chunk: target tile side, a positive integer (64 in the reference).
      weight_decay: ``λ``, non-negative; needs ``params`` in ``update`` when not 0.
      values: how the kept coefficients travel (:data:`compjax.compressors.chunktopk.VALUE_FORMATS`).
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs`` with state :class:`DemoState`; ``update(grads, state,
      params)``.

    Raises:
      ValueError: ``learning_rate`` not positive, ``decay`` outside [0, 1), ``weight_decay < 0``, and
        :func:`compjax.chunktopk`'s (build time); ``update`` without ``params`` while ``weight_decay != 0``.

    References:
      Peng, Quesnelle & Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870, 2024
      (Algorithm 1); code github.com/bloc97/DeMo, ``demo.py`` (``DeMo.step``, ``TransformDCT``,
      ``CompressDCT``).

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> tx = cj.demo(0.01, k=4, chunk=8)
      >>> params = {"w": jnp.ones((8, 8))}
      >>> updates, state = tx.update({"w": jnp.ones((8, 8))}, tx.init(params), params)
      >>> round(float(updates["w"][0, 0]), 6)   # the constant tile is one DCT coefficient, sent whole: sign 1
      -0.01
    """
    if not callable(learning_rate):
        check_range("learning_rate", learning_rate, 0.0, None, lo_open=True)
    check_range("decay", decay, 0.0, 1.0, hi_open=True)
    check_range("weight_decay", weight_decay, 0.0, None)
    inner = chunktopk(k, chunk=chunk, dct=True, values=values, decay=decay, aggregate="senders",
                      skip_nonfinite=skip_nonfinite, axis_name=axis_name)
    no_decay = isinstance(weight_decay, (int, float)) and weight_decay == 0

    def init_fn(params):
        return DemoState(*inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None and not no_decay:
            raise ValueError("demo's update needs params when weight_decay != 0: call tx.update(grads, state, params)")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        scaled = jax.tree.map(lambda g: (g * lr).astype(g.dtype) if is_compressible(g) else g, updates)
        agg, comm = inner.update(scaled, ChunktopkState(*state))
        ran = comm.count != state.count  # False on a step the non-finite guard skipped

        def step(a, p):
            if not is_compressible(a):
                return a
            u = -lr * jnp.sign(a)
            if not no_decay:
                u = jnp.where(ran, u - lr * weight_decay * p.astype(u.dtype), u)
            return u.astype(a.dtype)

        out = jax.tree.map(step, agg, updates if params is None else params)
        return out, DemoState(*comm)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
