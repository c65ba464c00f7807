"""Refuse worker-local state that claims to be replicated.

A ``jax.Array`` whose sharding is fully replicated (``P()``, or ``pmap``'s
``out_axes=None``) promises that every device holds the same copy, and JAX
reads it so: ``np.asarray`` and a checkpoint take one copy (the first device's),
a jitted program assumes any copy will do.  Worker-local state (error-feedback
residuals, DGC's velocity, PowerSGD's Q, random keys per worker) returned that
way breaks the promise: each device keeps its own worker's values under a
replicated sharding, and whatever reads the array sees worker 0's state only.
``jax.pmap(lambda g, s: tx.update(g, s), in_axes=(0, None), out_axes=(0, None))``
does exactly this (so does ``jax.shard_map`` with ``out_specs=P()`` and
``check_vma=False``), with no error.

:func:`check_replicas_agree` compares the copies of every such leaf and raises
a ``ValueError`` naming the leaf when they differ.  :meth:`Checkpointer.save
<compjax.checkpoint.Checkpointer.save>` and :func:`compjax.payload_bytes` call
it.  Keep worker-local state worker-stacked instead: a leading worker axis
sharded over the devices (``pmap`` with ``in_axes=0, out_axes=0`` for the
optimizer state, ``shard_map`` with ``P(axis)``, :mod:`compjax.parallel`).
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_replicas_agree"]

#: Copies of at most this many bytes are compared on the host even when ``exact=False`` (counters, flags).
SMALL_BYTES = 64

_FIX = ("keep worker-local state worker-stacked, with a leading worker axis sharded over the devices: "
        "jax.pmap(..., in_axes=0, out_axes=0) for the optimizer state (init it with jax.pmap(tx.init) on "
        "stacked parameters), jax.shard_map(..., in_specs=P(axis), out_specs=P(axis)), or compjax.parallel "
        "(replicate, init_worker_state, data_parallel_step)")


def check_replicas_agree(tree: Any, what: str, *, exact: bool = True) -> None:
    """Raise unless every fully replicated array in ``tree`` holds the same data on all its devices.

    A leaf is checked when it is a concrete ``jax.Array`` (not a tracer, not
    donated) whose sharding is fully replicated and that has more than one
    addressable shard (this process's copies); other leaves (worker-stacked
    arrays sharded over the devices, single-device arrays, NumPy) pass
    untouched, so a state in the worker-stacked layout costs nothing.  The
    copies are compared bit for bit (NaNs and signed zeros included; typed PRNG
    keys through ``jax.random.key_data``).

    Args:
      tree: a pytree of arrays (any dtype, typed PRNG keys included), an NNX
        ``State`` or NNX object.
      what: who is checking, for the message (e.g. ``"payload_bytes"``).
      exact: True (for checkpoints, whose arrays go to the host anyway): every
        copy of every checked leaf is brought to the host and compared.  False
        (cheap, for reading counters): copies of at most ``SMALL_BYTES`` bytes
        (counters, flags) are compared on the host; larger ones through a
        fingerprint of each copy (the wrapping sum of its 32-bit words and of
        a position-mixed hash of them), computed on each device by one jitted
        pass over all such leaves (compiled once per tree structure), so only 8
        bytes per copy leave the devices; a difference goes unnoticed only if
        both sums collide.  Arrays spanning several processes are compared on
        the host (this process's copies) in both modes.

    Raises:
      ValueError: a leaf's copies differ across devices; the message names the
        leaf's path, two devices whose copies differ, and the fix (keep
        worker-local state worker-stacked: ``pmap`` with ``in_axes=0,
        out_axes=0`` for the optimizer state, ``shard_map`` with ``P(axis)``).

    Examples:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from compjax import parallel
      >>> mesh = parallel.make_mesh()
      >>> shards = [jax.device_put(np.float32([i]), d) for i, d in enumerate(mesh.devices)]  # one value per device
      >>> x = jax.make_array_from_single_device_arrays((1,), NamedSharding(mesh, P()), shards)
      >>> check_replicas_agree({"residual": x}, "this example")
      Traceback (most recent call last):
      ...
      ValueError: this example: leaf ['residual'] is sharded as replicated (...), but its copies differ across ...
      >>> check_replicas_agree({"w": jax.device_put(np.ones(3), NamedSharding(mesh, P()))}, "this example")
    """
    nnx = sys.modules.get("flax.nnx")  # an NNX object: read its State (Flax is imported only if the caller did)
    if nnx is not None and isinstance(tree, nnx.Object):
        tree = nnx.state(tree)
    checked = [(path, x) for path, x in jax.tree_util.tree_leaves_with_path(tree) if _is_claimed_replica(x)]
    if not checked:
        return
    cheap = [not exact and _copy_bytes(x) > SMALL_BYTES and x.is_fully_addressable and _words_supported(x.dtype)
             for _, x in checked]
    groups = {}  # one jitted pass per sharding (leaves on other meshes cannot share a program)
    for i, ((_, x), c) in enumerate(zip(checked, cheap)):
        if c:
            groups.setdefault(x.sharding, []).append(i)
    prints = {}
    for idx in groups.values():
        prints.update(zip(idx, _fingerprints([checked[i][1] for i in idx])))
    for i, ((path, x), c) in enumerate(zip(checked, cheap)):  # in tree order: the first leaf that differs is named
        if c:
            copies = [(s.device, np.asarray(s.data)) for s in prints[i].addressable_shards]
        else:
            copies = [(s.device, _host_bits(s.data)) for s in x.addressable_shards]
        _raise_if_differ(path, copies, what)


def _is_claimed_replica(x: Any) -> bool:
    """A concrete jax.Array, fully replicated, with several copies in this process."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or x.is_deleted():
        return False
    return x.sharding.is_fully_replicated and len(x.addressable_shards) > 1


def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _copy_bytes(x: jax.Array) -> int:
    """Bytes of one device's copy of ``x`` (a typed key counts its key data)."""
    if _is_key(x.dtype):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return int(np.prod(data.shape, dtype=int)) * data.dtype.itemsize
    return x.size * np.dtype(x.dtype).itemsize


def _host_bits(data: jax.Array) -> np.ndarray:
    """One device's copy as host bits: an unsigned integer view, so NaNs and signed zeros compare exactly."""
    if _is_key(data.dtype):
        data = jax.random.key_data(data)
    a = np.asarray(data)
    if a.dtype.itemsize in (1, 2, 4, 8):
        return a.view(f"u{a.dtype.itemsize}")
    return a.view(np.uint8)


def _raise_if_differ(path: Any, copies: list, what: str) -> None:
    """Raise the ValueError of :func:`check_replicas_agree` unless all ``(device, host array)`` copies are equal."""
    (first_device, first), *rest = copies
    for device, other in rest:
        if not np.array_equal(first, other):
            raise ValueError(
                f"{what}: leaf {jax.tree_util.keystr(path)} is sharded as replicated (every device holding the same "
                f"copy), but its copies differ across devices ({first_device} and {device} hold different values): "
                f"worker-local state (residuals, velocities, counters, keys) returned under a replicated sharding, "
                f"e.g. by jax.pmap(..., out_axes=None) or jax.shard_map(..., out_specs=P(), check_vma=False); "
                f"reading it would see one worker's copy only. Fix: {_FIX}"
            )


def _words_supported(dtype: Any) -> bool:
    """Whether :func:`_words` can bitcast ``dtype`` (whole bytes of 1, 2, 4 or 8 per item, or complex)."""
    if _is_key(dtype) or dtype == jnp.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return True
    if jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    else:
        return False
    return bits in (8, 16, 32, 64) and bits == 8 * np.dtype(dtype).itemsize


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as a flat uint32 vector (any supported dtype)."""
    if _is_key(x.dtype):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.concatenate([_words(jnp.real(x)), _words(jnp.imag(x))])
    size = np.dtype(x.dtype).itemsize
    if size < 4:
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32).ravel()
    return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()  # 8-byte items give two words each


@jax.jit
def _fingerprints(leaves: list) -> list:
    """Per leaf, ``uint32[2]``: a position-weighted hash of all its bits, and their plain sum.

    The leaves are replicated, so each device runs this on its own copy (no
    collective is needed) and the result is again "replicated" with one
    fingerprint per device: its shards differ where the copies do.
    """
    out = []
    for x in leaves:
        w = _words(x)
        i = jnp.arange(w.size, dtype=jnp.uint32)
        h = w ^ (i * jnp.uint32(0x9E3779B9))  # mixed with the position: a permutation of the words changes it
        h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
        h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
        h = h ^ (h >> 16)
        out.append(jnp.stack([jnp.sum(h, dtype=jnp.uint32), jnp.sum(w, dtype=jnp.uint32)]))
    return out
