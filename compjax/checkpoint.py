"""Checkpoints of a worker-stacked training state, with orbax-checkpoint.

A training state here is any pytree: parameters and optimizer state in the
worker-stacked layout (:mod:`compjax.parallel`: leading axis of n workers,
sharded over the data axis), with every compressor's worker-local state inside
the optimizer state (residuals, velocities, PowerSGD's Q, skip counters, keys,
delayed-averaging buffers, DiLoCo's global parameters and outer state), plus
whatever else a run needs to resume (NumPy arrays such as a data order).
:class:`Checkpointer` saves it with ``orbax.checkpoint.CheckpointManager``
(every process writes its own shards; the files of a step appear atomically)
and restores it onto the shardings of a *target*: a state of the same
structure built the usual way (``parallel.replicate``,
``parallel.init_worker_state``) or its ``jax.ShapeDtypeStruct`` view, so
NamedTuple states come back typed and each worker's slice lands on its device.
Restored arrays are bit-identical to the saved ones.  Typed PRNG keys
(``jax.random.key(...)``, any implementation: NNX ``Rngs`` streams, keys in a
NamedTuple state, worker-stacked keys) are stored as their
``jax.random.key_data`` with their implementation's name, and come back as typed
keys of that implementation (``jax.random.wrap_key_data``) on the target's
sharding.

Sharded states whose leaves are stored padded (``parallel.Padded`` in the
``specs`` of :func:`compjax.parallel.fsdp_specs` / :func:`compjax.parallel.state_specs`)
are saved and restored with ``specs=``: the checkpoint holds the logical
arrays (the padding cut off, the signature's shapes logical), so it does not
depend on the fast axis size it was padded for, and is padded again onto
the target's shardings when restored.

Worker-local state must be worker-stacked: :meth:`Checkpointer.save` refuses an
array sharded as replicated whose copies differ across devices
(:func:`compjax.replicas.check_replicas_agree`), which a checkpoint would
otherwise store as one worker's copy.

Beside the arrays each step stores a JSON ``meta`` item: the state's
signature (worker count, state types, leaf shapes and dtypes) and a
caller-given ``extra`` dict (counters, a NumPy ``Generator``'s state, ...).
:meth:`Checkpointer.restore` compares the signature with the target's first and
raises a ``ValueError`` naming both sides when the worker axis (a
worker-stacked checkpoint restored into a one-worker target, or the
reverse: the message says how to replicate or unreplicate), the worker count, the state
types (e.g. another compressor's state), a leaf's shape or dtype, or the kind of
a key (typed ``key<fry>`` against raw ``uint32`` key data) differ.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Self

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from compjax.replicas import check_replicas_agree

__all__ = ["Checkpointer", "signature"]


def signature(state: Any) -> dict:
    """A JSON-able description of ``state``: worker count, state types and leaves.

    Args:
      state: a pytree of arrays (``jax.Array``, NumPy or ``ShapeDtypeStruct``;
        typed PRNG keys included).

    Returns:
      ``{"workers": n or None, "types": [names], "leaves": {path: [shape, dtype]},
      "keys": {path: impl}}``: ``workers`` is the leading dimension shared by
      most array leaves of rank >= 1 (the worker axis of a worker-stacked
      state; None when there are none), ``types`` the class names of the
      NamedTuples and registered pytree nodes (e.g. ``TopkState``) in tree order
      without repeats.  A typed PRNG key's entry in ``leaves`` has the key
      array's shape and its key dtype (``'key<fry>'``, ``'key<rbg>'``, ...; raw
      key data is ``'uint32'`` with a trailing key dimension), and ``keys``
      gives its implementation's name (``'threefry2x32'``, ...).

    Examples:
      >>> import jax
      >>> sig = signature({"rng": jax.random.key(0), "raw": jax.random.PRNGKey(0)})
      >>> sig["leaves"], sig["keys"]
      ({"['raw']": [[2], 'uint32'], "['rng']": [[], 'key<fry>']}, {"['rng']": 'threefry2x32'})
    """
    leaves, keys = {}, {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        name = jax.tree_util.keystr(path)
        if _is_key(leaf):
            leaves[name] = [list(leaf.shape), str(leaf.dtype)]
            keys[name] = _key_impl(leaf)
        else:
            leaves[name] = [list(np.shape(leaf)), str(np.dtype(leaf.dtype))]
    lead = Counter(shape[0] for shape, _ in leaves.values() if shape)
    treedef = str(jax.tree_util.tree_structure(state))
    names = re.findall(r"CustomNode\((?:namedtuple\[)?([\w.]+)", treedef)
    types = list(dict.fromkeys(names))
    return {"workers": lead.most_common(1)[0][0] if lead else None, "types": types, "leaves": leaves, "keys": keys}


def _is_key(x: Any) -> bool:
    """Whether ``x`` (an array or ``ShapeDtypeStruct``) holds typed PRNG keys."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_impl(x: Any) -> str:
    """The PRNG implementation's name of typed keys ``x`` (a key array or its ``ShapeDtypeStruct``)."""
    if isinstance(x, jax.Array):
        return str(jax.random.key_impl(x))
    found = []  # an abstract key: read the implementation while tracing
    jax.eval_shape(lambda k: found.append(str(jax.random.key_impl(k))), jax.ShapeDtypeStruct(x.shape, x.dtype))
    return found[0]


def _mismatch(saved: dict, wanted: dict, where: str) -> str | None:
    """Why the state described by ``saved`` cannot be restored as ``wanted`` (None if it can)."""
    extra = _extra_leading_axis(saved["leaves"], wanted["leaves"])
    if extra is not None:
        example = _example(saved["leaves"], wanted["leaves"])
        return (f"{where} is worker-stacked (a leading worker axis of {extra} on every array leaf, e.g. {example}), "
                "but this run's state has no worker axis: it was saved from the worker-stacked layout of a data-parallel "
                f"run. Restore it into a worker-stacked target (compjax.parallel.replicate(state, mesh) or "
                f"parallel.nnx_replicate(mesh, model, optimizer) on a mesh of {extra} workers, then restore), or "
                "restore it so and take one worker's copy with compjax.parallel.unreplicate (nnx_unreplicate for NNX "
                "objects)")
    extra = _extra_leading_axis(wanted["leaves"], saved["leaves"])
    if extra is not None:
        example = _example(wanted["leaves"], saved["leaves"])
        return (f"{where} has no worker axis (saved from one worker's state), but this run's state is worker-stacked "
                f"(a leading worker axis of {extra} on every array leaf, e.g. {example}): restore it "
                "into a one-worker target (the state before compjax.parallel.replicate / nnx_replicate, or "
                "parallel.unreplicate of this one), then replicate what was restored")
    if saved["workers"] != wanted["workers"]:
        return (f"{where} was saved by {saved['workers']} workers, but this run has {wanted['workers']} workers: "
                "restore onto the same worker count (worker-local state such as residuals is per worker)")
    if saved["types"] != wanted["types"]:
        return (f"{where} holds a state made of {', '.join(saved['types']) or 'plain containers'}, but this run's "
                f"state is made of {', '.join(wanted['types']) or 'plain containers'} (another compressor, "
                "algorithm or optimizer?)")
    for path in dict.fromkeys([*saved["leaves"], *wanted["leaves"]]):
        a, b = saved["leaves"].get(path), wanted["leaves"].get(path)
        if a and b and a[1].startswith("key<") != b[1].startswith("key<"):
            saved_typed = a[1].startswith("key<")
            typed, raw = ("the checkpoint", "this run") if saved_typed else ("this run", "the checkpoint")
            return (f"{where}: leaf {path} holds typed PRNG keys ({(a if saved_typed else b)[1]}) in {typed} but "
                    f"raw uint32 key data in {raw} (checkpoint: {a}, this run: {b}, as [shape, dtype]): "
                    "build the state with the same kind of key as the run that saved it "
                    "(jax.random.key(...) makes typed keys, jax.random.PRNGKey(...) raw key data)")
        if a and b and a[1].startswith("key<") and a[1] != b[1]:
            return (f"{where}: leaf {path} holds {a[1]} PRNG keys in the checkpoint but {b[1]} keys in this run: "
                    "another PRNG implementation (jax.random.key(..., impl=...) or jax_default_prng_impl)")
        if a != b:
            return (f"{where}: leaf {path} is {a or 'absent'} (shape, dtype) in the checkpoint but {b or 'absent'} "
                    "in this run (other compressor options, model or optimizer?)")
    return None


def _extra_leading_axis(stacked: dict, plain: dict) -> int | None:
    """``n`` if every array leaf of ``stacked`` is the leaf of ``plain`` at the same path with a leading axis of ``n``.

    Leaves are ``{path: [shape, dtype]}`` (:func:`signature`); leaves of rank 0 in
    ``plain`` (counters) count too.  None when the paths differ or any leaf does not fit.
    """
    if not stacked or set(stacked) != set(plain):
        return None
    lead = set()
    for path, (shape, dtype) in stacked.items():
        other = plain[path]
        if not shape or list(shape[1:]) != list(other[0]) or dtype != other[1]:
            return None
        lead.add(shape[0])
    return lead.pop() if len(lead) == 1 else None


def _example(stacked: dict, plain: dict) -> str:
    """One leaf of the two signatures, as ``path: (8, 3, 3, 1, 32) vs (3, 3, 1, 32)`` (the largest rank)."""
    path = max(stacked, key=lambda p: len(stacked[p][0]))
    return f"{path}: {tuple(stacked[path][0])} vs {tuple(plain[path][0])}"


def _abstract(x: Any) -> Any:
    """The restore target of one leaf: a ShapeDtypeStruct with the leaf's sharding (NumPy leaves as they are).

    Typed keys are restored as their key data: uint32 with the key's trailing
    dimension, sharded as the keys are (that dimension unsharded).
    """
    if _is_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=_key_data_sharding(x, data.ndim))
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


def _key_data_sharding(x: Any, ndim: int) -> Any:
    """The sharding of ``jax.random.key_data(x)`` (rank ``ndim``) for typed keys ``x`` with a sharding."""
    s = getattr(x, "sharding", None)
    if s is None or isinstance(s, SingleDeviceSharding):
        return s
    if isinstance(s, NamedSharding):
        return NamedSharding(s.mesh, P(*s.spec, *(None,) * (ndim - len(s.spec))), memory_kind=s.memory_kind)
    if isinstance(x, jax.Array):
        return jax.random.key_data(x).sharding
    raise ValueError(f"cannot restore typed PRNG keys onto a {type(s).__name__}: give the target as arrays, or as "
                     "ShapeDtypeStructs with a NamedSharding or SingleDeviceSharding")


def _wrap_keys(restored: Any, like: Any, impls: dict) -> Any:
    """``restored`` with the key data of every typed-key leaf of ``like`` wrapped back into keys, on its sharding."""
    def wrap(path, data, target):
        if not _is_key(target):
            return data
        impl = jax.random.key_impl(target) if isinstance(target, jax.Array) else impls[jax.tree_util.keystr(path)]
        keys = jax.random.wrap_key_data(data, impl=impl)
        sharding = getattr(target, "sharding", None)
        if sharding is not None and keys.sharding != sharding:
            keys = jax.device_put(keys, sharding)
        return keys

    return jax.tree_util.tree_map_with_path(wrap, restored, like)


def _logical_target(x: Any, entry: Any) -> Any:
    """The restore target of a padded leaf ``x`` (worker-stacked): its logical shape, placed over the worker axis only."""
    shape = tuple(np.shape(x)[:1]) + entry.shape
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(sharding.mesh, P(spec[0] if spec else None)))
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding) if sharding is not None else \
        np.zeros(shape, np.dtype(x.dtype))


def _padded_back(state: Any, like: Any, specs: Any) -> Any:
    """``state`` (restored logical arrays) with each padded leaf padded with zeros onto ``like``'s leaf's sharding."""
    from compjax.parallel.placement import Padded, is_spec_entry, mark_padded, pad

    def back(entry, sub, target):
        if not isinstance(entry, Padded):
            return sub
        sharding = getattr(target, "sharding", None)
        if sharding is None or not isinstance(sub, jax.Array):
            return pad(np.asarray(sub), entry, lead=1)
        return mark_padded(jax.jit(lambda a: pad(a, entry, lead=1), out_shardings=sharding)(sub))

    return jax.tree.map(back, specs, state, like, is_leaf=is_spec_entry)


def _key_data(x: Any) -> Any:
    """The leaf as saved: typed keys as their uint32 key data, anything else as it is."""
    return jax.random.key_data(x) if _is_key(x) else x


class Checkpointer:
    """Save and restore a (worker-stacked) training state in ``directory``, one subfolder per step.

    A thin layer over ``orbax.checkpoint.CheckpointManager`` with two items per
    step: ``state`` (the arrays, ``StandardSave``) and ``meta`` (JSON: the
    state's :func:`signature` and the caller's ``extra``).  Saves are
    asynchronous: :meth:`save` returns once the arrays are copied off the
    devices; :meth:`wait` (and :meth:`restore`, :meth:`close`) waits for the
    files.  With several processes (``jax.distributed``) every process makes the
    same calls, with ``directory`` on a file system they share.

    Args:
      directory: folder of the checkpoints (created if missing).
      max_to_keep: keep the newest ``max_to_keep`` steps (>= 1), delete older ones.

    Raises:
      ValueError: ``max_to_keep`` < 1.

    Examples:
      >>> import tempfile, jax.numpy as jnp, optax, compjax as cj
      >>> from compjax import parallel
      >>> mesh = parallel.make_mesh()
      >>> tx = optax.chain(cj.topk(0.5, axis_name="data"), optax.sgd(0.1))
      >>> init = {"w": jnp.ones(4)}
      >>> state = {"params": parallel.replicate(init, mesh), "opt": parallel.init_worker_state(tx, init, mesh)}
      >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
      ...     ckpt.save(20, state, extra={"epoch": 1})
      ...     restored, extra = ckpt.restore(state)      # the target gives structure and shardings
      >>> ckpt.latest_step(), extra, type(restored["opt"][0]).__name__
      (20, {'epoch': 1}, 'TopkState')
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2):
        if int(max_to_keep) < 1:
            raise ValueError(f"max_to_keep must be >= 1 (checkpoints kept), got {max_to_keep}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=int(max_to_keep), create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, state: Any, *, extra: dict | None = None, specs: Any = None) -> None:
        """Save ``state`` (and ``extra``, JSON-able) as step ``step`` (>= 0); asynchronous, see :meth:`wait`.

        With ``specs`` (a prefix of ``state`` whose leaves are ``PartitionSpec``,
        ``parallel.Padded`` or None, e.g. ``{"params": specs, "opt_state":
        parallel.state_specs(tx, params, specs, mesh)}``), every padded leaf is
        saved in its logical shape (:func:`compjax.parallel.logical`).

        The checkpoint holds the values at this call: ``extra`` is copied (and
        checked JSON-serializable) before the background write, so the caller
        may change it right away (the arrays are copied by Orbax before it
        returns; the tests check both).

        Typed PRNG keys are written as their ``jax.random.key_data`` (their
        implementation goes into the signature, see :func:`signature`).

        Raises:
          ValueError: ``step`` < 0 or not newer than the latest saved step; or an
            array sharded as replicated whose copies differ across devices
            (worker-local state returned by ``pmap(..., out_axes=None)``, see
            :func:`compjax.replicas.check_replicas_agree`): the checkpoint would
            hold one worker's copy only; ``specs`` that do not fit ``state``.
          TypeError: ``extra`` not JSON-serializable.
        """
        latest = self.latest_step()
        if step < 0 or (latest is not None and step <= latest):
            raise ValueError(f"step must be >= 0 and newer than the latest checkpoint ({latest}), got {step}")
        if specs is not None:
            from compjax.parallel.placement import logical

            state = logical(state, specs)
        check_replicas_agree(state, "Checkpointer.save")
        # The write happens in the background: snapshot the extra dict, which the caller may change next.
        meta = {"signature": signature(state), "extra": json.loads(json.dumps(extra or {}))}
        state = jax.tree.map(_key_data, state)
        self._manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                               meta=ocp.args.JsonSave(meta)), force=True)

    def latest_step(self) -> int | None:
        """The newest step saved in the directory (a save in flight included), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every step kept in the directory, oldest first."""
        return sorted(self._manager.all_steps())

    def restore(self, like: Any, *, step: int | None = None, specs: Any = None) -> tuple[Any, dict]:
        """Restore a saved state onto the structure, dtypes and shardings of ``like``.

        Args:
          like: a state of the same structure (arrays, e.g. the freshly
            initialized state of the run) or its ``jax.ShapeDtypeStruct`` view
            with shardings; NumPy leaves come back as NumPy arrays.
          step: the step to restore; default the latest.
          specs: as in :meth:`save`: ``like``'s padded leaves (stored padded)
            are compared with and restored from the logical arrays saved, and
            come back padded with zeros on ``like``'s shardings.

        Returns:
          ``(state, extra)``: the restored state (same pytree types as ``like``,
          arrays bit-identical to the saved ones, typed PRNG keys as typed keys
          of the saved implementation on ``like``'s shardings) and the ``extra``
          dict given to :meth:`save`.

        Raises:
          FileNotFoundError: no checkpoint in the directory (or not ``step``).
          ValueError: the checkpoint's worker count, state types or a leaf's
            shape or dtype differ from ``like``'s (the message names both),
            typed PRNG keys against raw ``uint32`` key data included; ``specs``
            that do not fit ``like``.
        """
        self.wait()
        step = self.latest_step() if step is None else int(step)
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint{'' if step is None else f' for step {step}'} in "
                                    f"{self.directory} (steps there: {self.all_steps()})")
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        padded_like = like
        if specs is not None:
            from compjax.parallel.placement import map_padded

            like = map_padded(_logical_target, like, specs)
        why = _mismatch(meta["signature"], signature(like), f"checkpoint {self.directory / str(step)}")
        if why:
            raise ValueError(why)
        target = jax.tree.map(_abstract, like)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        state = _wrap_keys(restored["state"], like, meta["signature"].get("keys", {}))
        if specs is not None:
            state = _padded_back(state, padded_like, specs)
        return state, meta["extra"]

    def wait(self) -> None:
        """Block until every save in flight is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for saves in flight and release the manager."""
        self._manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
