"""Mixed precision where parameters are used: a compute copy whose gradient stays in the compute dtype.

Large models keep float32 master parameters (and float32 optimizer and
error-feedback state) but compute in bfloat16.  Casting each parameter where
the model uses it (one layer's parameters inside ``jax.lax.scan``) keeps a
single layer's compute copy alive at a time, where casting the whole tree
before the loss (``data_parallel_step(compute_dtype=...)``) holds a bfloat16
copy of every parameter.  With a plain ``astype`` the gradient of a float32
parameter comes out in float32: a whole float32 gradient (4 bytes per
parameter) is built before the optimizer runs.  :func:`compute_cast` keeps it
in the compute dtype (2 bytes per parameter for bfloat16), as mixed-precision
trainers that reduce gradients in bfloat16 do.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["compute_cast"]


def _floating(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def floating_dtype(value: Any, name: str, *, none_ok: bool = False) -> Any:
    """``value`` as a floating-point ``jnp.dtype``; a ValueError naming the parameter ``name`` otherwise.

    With ``none_ok``, None is returned as it is (and the message says it is allowed).
    """
    if none_ok and value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be {'None or ' if none_ok else ''}a floating-point dtype (jnp.bfloat16, "
                         f"jnp.float16, jnp.float32), got {value!r}")
    return dtype


@functools.lru_cache(maxsize=None)
def _cast_leaf(dtype: Any):  # one custom_vjp per dtype
    @jax.custom_vjp
    def cast(x):
        return x.astype(dtype)

    def fwd(x):
        return x.astype(dtype), None

    def bwd(_, ct):
        return (ct,)  # the cotangent stays in the compute dtype (JAX accepts it for an inexact primal)

    cast.defvjp(fwd, bwd)
    return cast


def compute_cast(tree: Any, dtype: Any = jnp.bfloat16) -> Any:
    """The floating-point leaves of ``tree`` cast to ``dtype``, their gradient left in ``dtype``.

    Forward, this is ``x.astype(dtype)`` for every floating-point leaf
    (integer and boolean leaves pass unchanged).  Backward, the cotangent is
    passed on as it is, in ``dtype``, instead of being cast back to the
    leaf's own dtype: a float32 parameter used through ``compute_cast(p,
    jnp.bfloat16)`` gets a bfloat16 gradient, half the bytes of the float32
    one.  Call it inside the loss where each parameter is used (for stacked
    blocks, on one layer's parameters inside the ``jax.lax.scan`` body) so no
    bfloat16 copy of the whole model is held either.

    The step builders pass such gradients to the optimizer as they come
    (``data_parallel_step`` without ``compute_dtype``): a compressor's error
    feedback accumulates them into its own (float32) residual, a dense mean
    (``cj.identity``) sends them in bfloat16, and AdamW promotes them against
    its float32 moments; ``payload_bytes`` and
    :func:`compjax.audit_collectives` report the bytes actually sent.

    Args:
      tree: a pytree of arrays (e.g. one layer's float32 parameters).
      dtype: the compute dtype, a floating-point dtype (default ``jnp.bfloat16``).

    Returns:
      The same structure: floating-point leaves in ``dtype``, other leaves unchanged.

    Raises:
      ValueError: ``dtype`` is not a floating-point dtype.

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018 (float32
      master weights, 16-bit compute); Rajbhandari et al., "ZeRO", SC 2020
      (16-bit gradients reduced and partitioned, float32 optimizer state).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from compjax.parallel import compute_cast
      >>> w = jnp.ones((3,), jnp.float32)
      >>> jax.grad(lambda w: compute_cast(w).astype(jnp.float32).sum())(w).dtype
      dtype(bfloat16)
    """
    cast = _cast_leaf(floating_dtype(dtype, "dtype"))
    return jax.tree.map(lambda x: cast(x) if _floating(x) else x, tree)
