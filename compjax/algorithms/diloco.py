"""DiLoCo and Streaming DiLoCo (Douillard et al. 2023, 2025): infrequent, fragmented, overlapped synchronization."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import accounting, bytecount, collectives, layout
from compjax._checks import check_range
from compjax.codecs import ordering
from compjax.collectives import AxisName
from compjax.compressors.applying import applies_in_place
from compjax.compressors.base import any_nonfinite, is_compressible, silenced
from compjax.compressors.chains import holds_exchange
from compjax.compressors.identity import identity

_LOG = logging.getLogger("compjax")


class DilocoState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      inner: the inner optimizer's state (this worker's own: never synchronized),
        wrapped in ``optax.masked`` over the floating-point leaves.
      anchor: per fragment, the list of that fragment's global parameters
        ``θ_p`` as of its last synchronization (float32, or the parameters'
        dtype if wider): one copy of the model in all.
      outer: per fragment, the outer optimizer's state over that fragment's
        leaves (e.g. Nesterov momentum: one more copy of the model).
      comm: per fragment, the state of the compressor that carries the outer
        gradients (e.g. its error-feedback residual); its ``payload_bytes``
        counts the fragment's exchange in the last step (0 when it did not sync).
      pending: with ``overlap > 0``, per fragment, the outer gradient taken at
        the fragment's last synchronization and exchanged ``overlap`` steps
        later; an empty tuple when ``overlap == 0``.
      count: int32 scalar, inner steps taken (skipped ones included: it is the
        schedule's clock, the same on every worker).
      skipped: int32 scalar, inner steps this worker skipped because its
        gradient was not finite.
      payload_bytes: uint32 ``(2,)``, bytes of DiLoCo's own collectives in the
        last step: always 0 (everything goes through the compressors in
        ``comm``, which :func:`compjax.payload_bytes` adds).
    """

    inner: Any
    anchor: tuple
    outer: tuple
    comm: tuple
    pending: tuple
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def _is_float_leaf(x) -> bool:
    return is_compressible(x if hasattr(x, "dtype") else jnp.asarray(x))


def _is_index(k) -> bool:
    if isinstance(k, jax.tree_util.SequenceKey):
        return True
    return isinstance(getattr(k, "key", None), int) and not isinstance(getattr(k, "key", None), bool)


_NUMBERED = re.compile(r"^[A-Za-z]\w*_\d+$")  # a numbered attribute: encoderdecoderblock_0, Dense_3, layers_12


def _key_text(k) -> str | None:
    for attr in ("name", "key"):
        v = getattr(k, attr, None)
        if isinstance(v, str):
            return v
    return None


def _is_numbered(k) -> bool:
    text = _key_text(k)
    return text is not None and _NUMBERED.match(text) is not None


def _layer_of(path: tuple) -> tuple:
    """The layer a leaf belongs to: its path up to the first list index or numbered attribute, else its first key."""
    for i, k in enumerate(path[:-1]):  # the leaf's own name is never its layer
        if _is_index(k) or _is_numbered(k):
            return tuple(path[: i + 1])
    if path and _is_index(path[-1]):
        return tuple(path)
    return tuple(path[:1])


def _assigned(params: Any, fragments: int, assignment: Any) -> list[int | None]:
    """The fragment of every leaf (None for leaves never synchronized) from a user's ``assignment``."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    if callable(assignment):
        given = [assignment(path, x) if _is_float_leaf(x) else None for path, x in flat]
    else:
        try:
            given = jax.tree.structure(params).flatten_up_to(assignment)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "assignment must be a pytree shaped like the parameters (one fragment index per leaf) or a function "
                f"(key_path, leaf) -> fragment index; its structure does not match the parameters': {e}"
            ) from None
    out = []
    for (path, x), f in zip(flat, given):
        if not _is_float_leaf(x):
            out.append(None)
            continue
        name = jax.tree_util.keystr(path)
        if isinstance(f, bool) or not isinstance(f, (int, np.integer)):
            raise ValueError(f"assignment gives the parameter {name} {f!r}: every floating-point leaf needs a "  # noqa: TRY004
                             f"fragment index, an int in [0, {fragments})")
        if not 0 <= int(f) < fragments:
            raise ValueError(f"assignment gives the parameter {name} the fragment {int(f)}, outside [0, {fragments}) "
                             f"(fragments={fragments})")
        out.append(int(f))
    empty = sorted(set(range(fragments)) - {f for f in out if f is not None})
    if empty:
        raise ValueError(f"assignment leaves the fragments {empty} without a parameter: give each of the "
                         f"{fragments} fragments at least one floating-point leaf, or lower fragments")
    return out


def _unless(bad: jnp.ndarray, step: Any, updates: Any, new_state: Any, old: Any, params: Any,
            apply: bool = False) -> tuple:
    """``step(old, tied, params)`` (a pair: updates, new state) unless ``bad``, else zero updates and ``old``, bit for bit.

    ``(updates, new_state)`` is the step traced once outside (for their types only: XLA drops it).  The
    step runs in a loop of ``1 - bad`` trips (0 or 1, the same on a host's devices) carrying zero updates
    and the state, not as a selection after it: the new state is then written once, in place over the old
    (donated) one, and the updates read it.  (``where(bad, old, new)`` after the step has two passes read
    the old state, the updates and the selection, one of them writing it in place, and XLA copied every
    old AdamW moment: 8B model, 2 x 4 mesh, sharded Streaming DiLoCo, 8.5 GiB of temporaries.)  ``step``
    reads its closed-over inputs (gradients, parameters) through ``tied`` (the same values, selected on
    the loop's index), so that XLA does not hoist what it computes from them out of the loop, where each
    would be a buffer of its own.  Floating-point update leaves ride the loop; the others are selected
    after it.

    With ``apply`` (the in-place form, :func:`compjax.apply_gradients`), the loop carries the
    floating-point parameters instead of zero updates and adds the updates to them where they are
    computed: ``(new params, new state)`` is returned, the parameters as they were when ``bad``.  The
    updates of the whole model then never exist at once (8B model, 2 x 4 mesh, sharded SparseLoCo:
    7.4 GiB of float32 updates per device, out of the loop, before the step added them).
    """
    u_leaves, u_def = jax.tree.flatten(updates)
    p_leaves = jax.tree.leaves(params)
    inexact = lambda x: jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    rides = [inexact(u) and (not apply or inexact(p)) for u, p in zip(u_leaves, p_leaves)]
    first = [collectives.like_varying(p if apply else jnp.zeros_like(u), u)
             for u, p, r in zip(u_leaves, p_leaves, rides) if r]
    new_types = jax.tree.leaves(new_state)
    o_leaves, o_def = jax.tree.flatten(old)
    init = (first, jax.tree.unflatten(o_def, [collectives.like_varying(o, n) for o, n in zip(o_leaves, new_types)]))

    def body(i, carry):
        def tied(tree):  # the same values, read as the loop's (no pass computed from them leaves the loop)
            return jax.tree.map(lambda x: ordering.tie(x, i) if inexact(x) else x, tree)

        if apply:  # the parameters: the carried ones where they ride, the others read through tied
            it = iter(carry[0])
            now = jax.tree.unflatten(jax.tree.structure(params), [next(it) if r else p for p, r in zip(p_leaves, rides)])
            u, st = step(carry[1], tied, now)
            ups = [x for x, r in zip(jax.tree.leaves(u), rides) if r]
            out = [(p + x).astype(p.dtype) for p, x in zip(carry[0], ups)]  # optax.apply_updates, leaf by leaf
        else:
            u, st = step(carry[1], tied, tied(params))
            out = [x for x, r in zip(jax.tree.leaves(u), rides) if r]
        return collectives.match_varying((out, st), carry)

    ridden, new = jax.lax.fori_loop(0, 1 - bad.astype(jnp.int32), body, init)
    it = iter(ridden)
    if not apply:
        out = [next(it) if r else jnp.where(bad, jnp.zeros_like(u), u) for u, r in zip(u_leaves, rides)]
        return jax.tree.unflatten(u_def, out), new
    out = [next(it) if r else optax.apply_updates(p, jnp.where(bad, jnp.zeros_like(u), u))
           for u, p, r in zip(u_leaves, p_leaves, rides)]
    return jax.tree.unflatten(jax.tree.structure(params), out), new


def _merge_body(params: Sequence, new_anchor: Sequence, dtypes: Sequence, start, due, alpha) -> Any:
    """The body of the one-trip loop that stores an overlapped fragment's Δ and merges its updates.

    ``body(i, (pending, updates))`` gives, leaf by leaf, with ``θ = p + u`` (the local parameters after
    this step, in the global copy's dtype) and ``θ̃`` the fragment's global copy after this step's
    synchronization: the stored outer gradient ``θ̃ - θ`` where a synchronization ``start`` s (else the
    stored one), and the updates to ``α θ + (1 − α) θ̃`` where one is ``due`` to merge (else ``u``).
    ``params`` and ``new_anchor`` are read through :func:`compjax.codecs.ordering.tie`, so nothing computed from them leaves the loop.
    """

    def body(i, carry):
        pend, ups = carry
        out_p, out_u = [], []
        for p, n, old, u, d in zip(params, new_anchor, pend, ups, dtypes):
            p, n = ordering.tie(p, i), ordering.tie(n, i)
            x = p.astype(d) + u.astype(d)  # θ = p + u
            out_p.append(jnp.where(start, n - x, old))
            m = alpha * x + (1 - alpha) * n
            out_u.append(jnp.where(due, (m - p.astype(m.dtype)).astype(u.dtype), u))
        return collectives.match_varying((out_p, out_u), carry)

    return body


def fragment_assignment(params: Any, fragments: int, assignment: Any = None) -> list[list[int]]:
    """Which leaves of ``params`` each fragment holds (indices into ``jax.tree.leaves(params)``).

    The rule, for any pytree: only floating-point leaves with at least one
    element take part (others are never synchronized).  A leaf's *layer* is its
    key path up to and including the first key (other than the leaf's own
    name) that is a sequence index (``("blocks", 3)`` for every leaf of the
    fourth entry of a list of blocks, an ``nnx.List``) or a **numbered
    attribute**, a name ending in ``_<digits>`` (``("decoder",
    "encoderdecoderblock_2")`` for the blocks of Flax's LM example, Linen's
    ``Dense_0``, ``self.block_3``); when the path has neither, its first key
    (``("embed",)``).  Layers are numbered in the order of ``jax.tree.leaves``.
    With at least ``fragments`` layers, layer ``j`` goes to fragment
    ``j mod fragments`` (strided, as the paper strides transformer blocks);
    with fewer layers, leaf ``i`` goes to fragment ``i mod fragments``.
    With ``assignment="bytes"``, where that split leaves the largest fragment
    more than 1.25 times the bytes of the smallest (a language model whose
    embedding and output projection each outweigh a block), fragments are
    balanced by bytes instead: the same units (layers, or leaves), largest
    first, each to the fragment holding the fewest bytes so far; where layers
    are too coarse for that, leaves.  Layers of equal size still go round the
    fragments in turn.
    :func:`describe_fragments` prints the split.

    Args:
      params: the parameters (any pytree).
      fragments: the number of fragments, an int >= 1.
      assignment: ``"bytes"`` (the rule, balanced by bytes, see above), or a
        split of one's own instead of the rule: a pytree shaped
        like ``params`` holding each leaf's fragment index (any value at the
        leaves never synchronized), or a function ``(key_path, leaf) ->
        fragment index`` called on every floating-point leaf.

    Returns:
      ``fragments`` lists of leaf indices, each in increasing order.

    Raises:
      ValueError: ``fragments`` larger than the number of floating-point
        leaves; an ``assignment`` whose structure does not match ``params``,
        that leaves a floating-point leaf without an int index, gives an
        index outside ``[0, fragments)`` or leaves a fragment empty (naming
        the parameter).
    """
    paths = [
        (i, path)
        for i, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(params))
        if _is_float_leaf(x)
    ]
    if fragments > len(paths):
        raise ValueError(
            f"fragments must be an integer in [1, {len(paths)}] (the number of floating-point parameter "
            f"leaves), got {fragments}"
        )
    by_bytes = isinstance(assignment, str) and assignment == "bytes"
    if isinstance(assignment, str) and not by_bytes:
        raise ValueError(f"assignment must be 'bytes', a pytree of fragment indices or a function, got {assignment!r}")
    if assignment is not None and not by_bytes:
        given = _assigned(params, fragments, assignment)
        return [[i for i, f in enumerate(given) if f == p] for p in range(fragments)]
    layers: dict[tuple, int] = {}
    for _, path in paths:
        layers.setdefault(_layer_of(path), len(layers))
    out: list[list[int]] = [[] for _ in range(fragments)]
    for j, (i, path) in enumerate(paths):
        frag = layers[_layer_of(path)] % fragments if len(layers) >= fragments else j % fragments
        out[frag].append(i)
    leaves = jax.tree.leaves(params)
    nbytes = {i: int(np.prod(np.shape(leaves[i]))) * jnp.dtype(leaves[i].dtype).itemsize for i, _ in paths}
    if not by_bytes or fragments == 1 or _balanced(out, nbytes):
        return out
    by_layer: dict[int, list[int]] = {}
    for i, path in paths:
        by_layer.setdefault(layers[_layer_of(path)], []).append(i)
    units = list(by_layer.values()) if len(layers) >= fragments else [[i] for i, _ in paths]
    best = _largest_first(units, nbytes, fragments)
    if not _balanced(best, nbytes):  # layers too coarse for the fragments: leaf by leaf
        best = _largest_first([[i] for i, _ in paths], nbytes, fragments)
    return best


#: The largest fragment's bytes over the smallest's above which the strided split is rebalanced.
_BALANCE = 1.25


def _balanced(frags: list[list[int]], nbytes: dict) -> bool:
    sizes = [sum(nbytes[i] for i in f) for f in frags]
    return min(sizes) > 0 and max(sizes) <= _BALANCE * min(sizes)


def _largest_first(units: list[list[int]], nbytes: dict, fragments: int) -> list[list[int]]:
    """Units (lists of leaf indices) to fragments largest first, each to the fragment holding the fewest bytes
    so far (ties: the lower fragment, then the earlier unit); each fragment's leaves in increasing order."""
    sizes, out = [0] * fragments, [[] for _ in range(fragments)]
    order = sorted(range(len(units)), key=lambda u: (-sum(nbytes[i] for i in units[u]), u))
    for u in order:
        f = min(range(fragments), key=lambda k: (sizes[k], k))
        out[f].extend(units[u])
        sizes[f] += sum(nbytes[i] for i in units[u])
    return [sorted(f) for f in out]


def describe_fragments(params: Any, fragments: int, assignment: Any = None) -> str:
    """How :func:`diloco` splits ``params`` into fragments: one line per fragment, its layers and parameter count.

    Args:
      params, fragments, assignment: as for :func:`fragment_assignment`.

    Returns:
      ``fragments`` lines ``fragment p: N parameters in L leaves: <layers>``
      (layers as key paths, e.g. ``['decoder']['encoderdecoderblock_0']``).

    Examples:
      >>> import jax.numpy as jnp
      >>> params = {"block_0": {"w": jnp.ones((2, 2))}, "block_1": {"w": jnp.ones((2, 2))}, "head": jnp.ones(2)}
      >>> print(describe_fragments(params, 2))
      fragment 0: 6 parameters in 2 leaves: ['block_0'], ['head']
      fragment 1: 4 parameters in 1 leaves: ['block_1']
    """
    flat = jax.tree_util.tree_leaves_with_path(params)
    lines = []
    for p, idx in enumerate(fragment_assignment(params, fragments, assignment)):
        layers = list(dict.fromkeys(jax.tree_util.keystr(_layer_of(flat[i][0])) for i in idx))
        size = sum(int(np.size(flat[i][1])) for i in idx)
        lines.append(f"fragment {p}: {size:,} parameters in {len(idx)} leaves: {', '.join(layers)}")
    return "\n".join(lines)


def diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    outer: optax.GradientTransformation | None = None,
    fragments: int = 1,
    overlap: int = 0,
    alpha: float = 0.5,
    compressor: optax.GradientTransformation | None = None,
    skip_nonfinite: bool = True,
    assignment: Any = None,
    axis_name: AxisName,
) -> optax.GradientTransformationExtraArgs:
    r"""DiLoCo: ``sync_every`` local inner steps, then an outer step on the averaged outer gradient.

    Douillard et al. 2023 (Algorithm 1), and Streaming DiLoCo (Douillard et al.
    2025, Algorithm 2) with ``fragments`` and ``overlap``.  Each call of
    ``update(grads, state, params)`` is one **inner step** of this worker: it
    returns the updates that move the worker's local parameters ``θ``
    (``optax.apply_updates(params, updates)``), computed by ``inner`` from the
    local gradients.  Inner optimizer states are never synchronized.

    Parameters are split into ``fragments`` groups (:func:`fragment_assignment`);
    fragment ``p`` has the offset ``t_p = (p * H) // fragments`` and
    synchronizes after inner step ``s`` whenever ``s ≡ t_p (mod H)`` (``s >= 1``,
    ``H = sync_every``), so each fragment syncs once every ``H`` steps and, the
    offsets being spread over ``H``, the bytes of one synchronization are spread
    over ``fragments`` steps.  A synchronization of fragment ``p`` after step
    ``s`` (local parameters ``θ_p(s)``, global ``θ^g_p`` from its last one)::

        Δ_p   = θ^g_p − θ_p(s)                       (outer gradient: old minus new)
        Δ̄_p   = mean over workers of C(Δ_p)          (C = compressor: fp32 all-reduce by default)
        θ̃_p   = θ^g_p + OuterOpt(Δ̄_p)                (default Nesterov SGD, lr 0.7, momentum 0.9)
        θ^g_p ← θ̃_p

    and then, with ``overlap = 0``, the local parameters take the new global
    values: ``θ_p ← θ̃_p`` (plain DiLoCo; ``alpha`` plays no part).  With
    ``overlap = τ > 0``, ``Δ_p`` is kept in the state at step ``s`` and
    exchanged in step ``s + τ``, whose collective reads only that stored value
    (no data dependency on the ``τ`` inner steps in between: the exchange may
    run while they compute); after step ``s + τ`` the local parameters merge::

        θ_p ← α · θ_p(s + τ) + (1 − α) · θ̃_p

    (``α`` weights the local side; 0.5 in the paper).  In compjax the exchange
    happens inside step ``s + τ``, so it overlaps that step's computation; a
    system with asynchronous collectives would give it ``τ`` steps.

    Exact equivalence: with ``sync_every=1``, ``inner=optax.sgd(η)``,
    ``outer=optax.sgd(1.0)`` and the default compressor, every step sets
    ``θ ← θ − η · mean_i g_i``: synchronous data-parallel SGD (tested to 1e-6).

    Every step is one compiled program: each fragment's synchronization sits
    in a loop of one trip on the steps where the fragment syncs and of none on
    the others (a loop updates the global copy, the outer state and the
    compressor state in place, where a ``lax.cond`` would copy them), so
    collectives run only on the steps where a fragment syncs
    (``payload_bytes`` is 0 on the others).  With the
    non-finite guard a worker whose gradient is not finite skips its own inner
    step (zero update, inner state kept, ``skipped`` + 1); inner steps are
    local, so no vote is needed and the other workers carry on; the clock
    ``count`` advances on every worker alike.  Integer and boolean parameters
    (``float0`` gradients) and empty leaves pass through untouched: the inner
    optimizer sees only the floating-point leaves (``optax.masked``), and only
    they are synchronized.

    **Memory**: besides the inner state, one copy of the parameters (the global
    ones, float32), the outer optimizer's state (one more with momentum), the
    compressor's state, and with ``overlap > 0`` one more copy (the pending
    outer gradients).  With ``overlap = 0``, :func:`compjax.apply_gradients`
    (which every step builder of :mod:`compjax.parallel` calls) runs the step
    in place: each inner update is added to the parameters where the inner
    optimizer computes it, and a synchronization writes the new global
    parameters over the local ones (``θ ← θ̃`` exactly), so the updates of the
    whole model are never held at once.

    Args:
      inner: the inner optimizer (e.g. ``optax.adamw(4e-4, weight_decay=0.1)``).
      sync_every: ``H``, inner steps between two synchronizations of a
        fragment, an integer >= 1.
      outer: the outer optimizer, applied to the averaged outer gradient; default
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      fragments: number of parameter fragments synchronized in turn, an integer
        in [1, number of floating-point parameter leaves] (the upper bound is
        checked by ``init``).
      overlap: ``τ``, inner steps between the start of a fragment's
        synchronization and the merge of its result, an integer in
        [0, sync_every).
      alpha: weight of the local parameters in the merge after an overlapped
        synchronization, in [0, 1]; unused when ``overlap == 0``.
      compressor: a compjax compressor over ``axis_name`` for the outer
        gradients (its state kept per fragment), or None for a float32 dense
        all-reduce (:func:`compjax.identity`).
      skip_nonfinite: skip a worker's inner step when its gradient is not finite.
      assignment: the split into fragments, if not by the rule of
        :func:`fragment_assignment` (numbered layers strided over the
        fragments): ``"bytes"`` (the rule, balanced by bytes where its
        fragments differ by more than 25%: a language model whose embedding
        and output projection outweigh a block), a pytree like the parameters
        holding each leaf's fragment index, or a function ``(key_path, leaf) ->
        fragment index``; checked at
        ``init`` (every floating-point leaf assigned, indices in
        ``[0, fragments)``, no fragment empty).  Pass the same to
        :func:`diloco_global_params`.  ``init`` logs the split (logger
        ``compjax``, level INFO; :func:`describe_fragments`).
      axis_name: the worker axis (None: one worker).

    Returns:
      ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
      params)`` needs ``params``: this worker's local parameters before the step.

    Raises:
      ValueError: ``sync_every < 1``, ``fragments < 1``, ``overlap`` outside
        ``[0, sync_every)``, ``alpha`` outside ``[0, 1]``, ``inner``, ``outer`` or
        ``compressor`` not an optax transformation (build time); ``fragments``
        more than the parameter leaves, or a bad ``assignment`` (``init``,
        naming the parameter); ``update`` called without ``params``.

    References:
      Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam &
      Shen, "DiLoCo: Distributed Low-Communication Training of Language
      Models", 2023.  Douillard, Donchev, Rush, Kale, Rusu, Sankararaman,
      Garg, Cohen, Szlam et al., "Streaming DiLoCo with overlapping
      communication: Towards a Distributed Free Lunch", 2025 (Algorithm 2).

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> tx = cj.diloco(optax.sgd(0.1), sync_every=2, axis_name=None)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> for _ in range(2):
      ...     updates, state = tx.update({"w": jnp.ones(3)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> [round(float(x), 4) for x in params["w"]]   # one worker: Δ = 0.2, Nesterov step 0.7 * (1 + 0.9) * 0.2
      [0.734, 0.734, 0.734]
      >>> int(cj.message_bytes(state))   # the message of step 2's sync: 3 float32 (one worker: nothing sent)
      12
    """
    check_range("sync_every", sync_every, 1, None, integer=True, static=True)
    check_range("fragments", fragments, 1, None, integer=True, static=True)
    check_range("overlap", overlap, 0, sync_every, hi_open=True, integer=True, static=True)
    check_range("alpha", alpha, 0.0, 1.0)
    for name, tx in (("inner", inner), ("outer", outer), ("compressor", compressor)):
        if tx is not None and not isinstance(tx, optax.GradientTransformation):
            raise ValueError(f"{name} must be an optax GradientTransformation{'' if name == 'inner' else ' or None'}"
                             f", got {tx!r}")
    if inner is None:
        raise ValueError("inner must be an optax GradientTransformation, got None")
    H, P, tau = int(sync_every), int(fragments), int(overlap)
    offsets = [(p * H) // P for p in range(P)]
    # Integer and boolean parameters (float0 gradients) and empty leaves pass through: the inner optimizer
    # sees the floating-point leaves only, as the compressors do.
    inner_tx = optax.with_extra_args_support(optax.masked(inner, lambda tree: jax.tree.map(_is_float_leaf, tree)))
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
    comm_tx = identity(axis_name, skip_nonfinite=False) if compressor is None else compressor
    # An inner optimizer holding a compjax compressor may run collectives across workers, whose skip flags
    # differ: its step then runs on every worker and the skip selects after it (not in a loop of 0 or 1 trips).
    inner_exchanges = holds_exchange(inner)

    def wide(x):
        return jnp.promote_types(x.dtype, jnp.float32)

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        frags = fragment_assignment(params, P, assignment)
        if P > 1:
            _LOG.info("cj.diloco splits the parameters into %d fragments:\n%s", P,
                      describe_fragments(params, P, assignment))
        anchor = tuple([jnp.array(leaves[i], dtype=wide(leaves[i]), copy=True) for i in idx] for idx in frags)
        return DilocoState(
            inner=inner_tx.init(params),
            anchor=anchor,
            outer=tuple(outer_tx.init(a) for a in anchor),
            comm=tuple(comm_tx.init(a) for a in anchor),
            pending=tuple([jnp.zeros_like(x) for x in a] for a in anchor) if tau else (),
            count=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
            payload_bytes=bytecount.zeros(),
        )

    def exchange(delta: Sequence, anchor: Sequence, outer_state, comm_state, dims):
        with layout.for_leaves(delta, dims):  # sharded parameters: which of the fragment's leaves are shards
            mean, comm_state = comm_tx.update(list(delta), comm_state)
        step, outer_state = outer_tx.update([m.astype(a.dtype) for m, a in zip(mean, anchor)], outer_state, anchor)
        return optax.apply_updates(list(anchor), step), outer_state, comm_state

    def fragment_sync(due, sent, anchor, outer_state, comm_state, dims, own, ups):
        """One fragment's synchronization when ``due``: ``(anchor, outer_state, comm_state, own)`` after it.

        A loop of one trip when ``due`` and none otherwise (the same on every worker), not a ``lax.cond``:
        a loop's carry is updated in place, where a ``lax.cond`` passing the fragment's global copy, outer
        state and compressor state through would copy them (XLA keeps an operand of a conditional apart
        from its output).  ``sent(anchor, own)`` gives the fragment's outer gradients, computed inside the
        loop; ``own`` (the inner updates of the fragment's leaves, or ``[]``) is carried too and replaced by
        ``ups(new anchor, own)`` after the synchronization, so that nothing computed from it outlives the
        loop.  On a step without a synchronization the state is returned as it was, with the compressor's
        ``payload_bytes`` set to 0.
        """

        def body(_, carry):
            anchor, outer_state, comm_state, own = carry
            new, o_st, c_st = exchange(sent(anchor, own), anchor, outer_state, comm_state, dims)
            return collectives.match_varying((new, o_st, c_st, ups(new, own)), carry)

        with jax.named_scope(accounting.BRANCH_LOOP_SCOPE):  # the audit counts the loop's collectives as a branch
            new, o_st, c_st, own = jax.lax.fori_loop(0, due.astype(jnp.int32), body,
                                                     (list(anchor), outer_state, comm_state, list(own)))
        quiet = silenced(c_st)  # the same leaves but payload_bytes: 0 when nothing was sent
        c_st = jax.tree.map(lambda x, q: x if x is q else jnp.where(due, x, q), c_st, quiet)
        return new, o_st, c_st, own

    def run(grads, state, params, extra_args, apply):
        """One inner step: ``(updates, new_state)``, or with ``apply`` ``(new_params, new_state)``."""
        if params is None:
            raise ValueError(
                "diloco's update needs the worker's local parameters: call tx.update(grads, state, params) "
                "(optax.chain passes them on when it is given them)"
            )
        dims = layout.shard_dims_for(grads, "cj.diloco")
        updates, inner_state = inner_tx.update(grads, state.inner, params, **extra_args)
        if len(jax.tree.leaves(updates)) != len(jax.tree.leaves(params)):
            raise ValueError("the inner optimizer's updates do not match params: was the state built for them?")
        moved = None  # with apply: the parameters after the inner step
        skipped = state.skipped
        if skip_nonfinite:
            checked = [g for g in jax.tree.leaves(grads) if is_compressible(g)]
            bad = any_nonfinite(checked) if checked else jnp.bool_(False)
            bad = collectives.any_over_fast(bad)  # sharded parameters: one host's shards skip together
            if inner_exchanges:  # its collectives must run on every worker, skipped or not: select after it
                updates = jax.tree.map(lambda u: jnp.where(bad, jnp.zeros_like(u), u), updates)
                inner_state = jax.tree.map(lambda n, o: jnp.where(bad, o, n), inner_state, state.inner)
            else:
                out, inner_state = _unless(
                    bad, lambda st, tied, now: inner_tx.update(tied(grads), st, now, **extra_args),
                    updates, inner_state, state.inner, params, apply)
                if apply:
                    moved = out
                else:
                    updates = out
            skipped = skipped + bad.astype(jnp.int32)
        elif apply and not inner_exchanges:  # the same loop, of one trip (``count < 0`` never holds)
            moved, inner_state = _unless(
                state.count < 0, lambda st, tied, now: inner_tx.update(tied(grads), st, now, **extra_args),
                updates, inner_state, state.inner, params, apply)
        if tau == 0:  # (with an overlap the compiled step grew with it instead: 8B model, 2 x 4 mesh, sharded)
            # Written through a boundary (ordering.settled): XLA copies the old state (the updates and the new
            # state are two passes that read it, one writing in place), and without it the pass that writes the
            # new state ran after the synchronization, keeping those copies alive through it (8B model, 2 x 4
            # mesh, sharded: 2.1 GiB of temporaries less with it).
            inner_state = ordering.settled(inner_state, state.count)
        p_leaves = jax.tree.leaves(params)
        u_leaves = jax.tree.leaves(updates)
        if apply and moved is None:
            moved = optax.apply_updates(params, updates)
        # With apply the synchronization reads and writes the parameters θ after the inner step (m_leaves) in
        # place; without, it reads θ = p + u and writes the updates (u_leaves).
        m_leaves = jax.tree.leaves(moved) if apply else None
        frags = fragment_assignment(params, P, assignment)
        s = state.count + 1  # inner steps done after this one
        anchors, outers, comms, pendings = [], [], [], []
        for p, idx in enumerate(frags):
            pending = None
            anchor, outer_state, comm_state = state.anchor[p], state.outer[p], state.comm[p]
            f_dims = None if dims is None else [dims[i] for i in idx]
            if tau == 0:  # Δ of this step, exchanged now; the workers take the new global values
                due = (s - offsets[p]) % H == 0

                if apply:
                    def sent(a, own):  # Δ = θ^g - θ: computed inside the synchronization
                        return [x - t.astype(x.dtype) for x, t in zip(a, own)]

                    def ups(new, own):  # the local parameters take the new global ones
                        return [n.astype(t.dtype) for n, t in zip(new, own)]
                else:
                    def sent(a, own, idx=idx):  # Δ = θ^g - θ, θ = p + u: computed inside the synchronization
                        return [x - (p_leaves[i].astype(x.dtype) + u.astype(x.dtype)) for i, x, u in zip(idx, a, own)]

                    def ups(new, own, idx=idx):  # the updates that move the local parameters to the new global ones
                        return [(n - p_leaves[i].astype(n.dtype)).astype(u.dtype) for i, n, u in zip(idx, new, own)]

                carried = m_leaves if apply else u_leaves
                new_anchor, outer_state, comm_state, own = fragment_sync(
                    due, sent, anchor, outer_state, comm_state, f_dims, [carried[i] for i in idx], ups)
                for i, up in zip(idx, own):
                    carried[i] = up
            else:  # Δ stored tau steps ago, exchanged now; merged with weight alpha on the local side
                due = (s - tau >= 1) & ((s - tau - offsets[p]) % H == 0)
                new_anchor, outer_state, comm_state, _ = fragment_sync(
                    due, lambda a, own, pend=state.pending[p]: pend, anchor, outer_state, comm_state, f_dims, [],
                    lambda new, own: own)
                # A new synchronization starts after this step: keep its outer gradient, Δ from the anchor
                # before any merge of this step.  A start and a merge never fall on one step (tau < H), so
                # on a start the anchor after the (skipped) synchronization is that anchor, bit for bit; read
                # after the synchronization, the stored Δ overwrites the old one in place.
                start = (s - offsets[p]) % H == 0

                # In a loop of one trip: every read of the parameters (for Δ and the merge) is done when the
                # updates come out, before the step writes the new parameters over them (donated); computed
                # beside the step's parameter update, the stored Δ was computed after it, and XLA kept a copy
                # of the parameters through the whole step (8B model, 2 x 4 mesh, sharded: 7.1 GiB).
                merge = _merge_body([p_leaves[i] for i in idx], new_anchor, [a.dtype for a in anchor], start, due,
                                    alpha)
                pending, ups = jax.lax.fori_loop(0, ordering.one_trip(state.count), merge,
                                                 (list(state.pending[p]), [u_leaves[i] for i in idx]))
                for i, up in zip(idx, ups):
                    u_leaves[i] = up
            anchors.append(new_anchor)
            outers.append(outer_state)
            comms.append(comm_state)
            pendings.append(pending)
        new_state = DilocoState(
            inner=inner_state,
            anchor=tuple(anchors),
            outer=tuple(outers),
            comm=tuple(comms),
            pending=tuple(pendings) if tau else (),
            count=s,
            skipped=skipped,
            payload_bytes=state.payload_bytes,
        )
        if apply:
            return jax.tree.unflatten(jax.tree.structure(params), m_leaves), new_state
        return jax.tree.unflatten(jax.tree.structure(updates), u_leaves), new_state

    def update_fn(grads, state, params=None, **extra_args):
        return run(grads, state, params, extra_args, False)

    def apply_fn(grads, state, params=None, **extra_args):
        return run(grads, state, params, extra_args, True)

    # Its own steps are elementwise and per leaf (fragments, anchors, outer steps): it works on shards cut any
    # way when its compressor and inner optimizer do (compjax.compressors.chains.works_on_any_cut).
    update_fn.any_cut = apply_fn.any_cut = True


    tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    # Without overlap the parameters are written in place where the inner step and the synchronization compute
    # them (compjax.apply_gradients); with one, the merge keeps optax's two calls.
    return applies_in_place(tx, apply_fn) if tau == 0 else tx


def _find_diloco_state(opt_state: Any) -> DilocoState:
    """The one :class:`DilocoState` inside an optax state (chained, injected, wrapped), or ValueError."""
    is_state = lambda x: isinstance(x, DilocoState)
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
    if len(found) != 1:
        raise ValueError(
            f"opt_state must hold exactly one DilocoState (the state of cj.diloco, alone or inside optax.chain, "
            f"optax.inject_hyperparams or another wrapper), found {len(found)}"
        )
    return found[0]


def diloco_global_params(opt_state: Any, params: Any, *, assignment: Any = None) -> Any:
    r"""The global model of a DiLoCo or Streaming DiLoCo run: the parameters to evaluate.

    Between synchronizations each worker trains its own local parameters
    ``θ`` (what ``params`` holds and what the inner steps move); the model the
    method produces is the global one, ``θ^g``, the outer optimizer's iterate
    (Douillard et al. 2023, Algorithm 1: the outer parameters ``θ^(t)``).
    :func:`diloco` keeps it in its state, per fragment (``DilocoState.anchor``);
    this function reassembles it in the shape of ``params``:

    * every floating-point leaf that DiLoCo synchronizes takes its fragment's
      global value as of that fragment's last synchronization, cast to the
      leaf's dtype (the state holds it in float32, or wider);
    * every other leaf (integer and boolean leaves, empty leaves: DiLoCo never
      synchronizes them) is the one in ``params``.

    Before a fragment's first synchronization its global value is the
    initialization.  Right after a synchronization of plain DiLoCo
    (``overlap == 0``) the workers hold the global values too (up to the float32
    rounding of ``params + updates``); between synchronizations they do not,
    and neither they nor their mean are the global model.  With Streaming
    DiLoCo (Douillard et al. 2025) fragments synchronize at different steps, so
    the global model joins each fragment's last global value, whatever step it
    was taken at; with ``overlap > 0`` a fragment whose outer gradient is
    pending (taken, not yet exchanged and merged) still contributes its last
    *merged* global value: the pending outer step needs the all-reduce that
    has not happened yet, and no worker can compute it alone.

    The result is computed from the state alone (no collective), under
    ``jax.shard_map``, ``jax.jit`` or eagerly; every worker holds the same
    global model (each outer step is taken on the averaged outer gradient,
    which every worker receives).
    It holds new buffers (nothing aliases ``opt_state`` or ``params``), so it
    stays valid after the state is donated to the next step.

    Args:
      opt_state: the optimizer state holding one :class:`DilocoState`: the state
        of :func:`diloco` itself or of any optax combinator around it
        (``optax.chain``, ``optax.inject_hyperparams``, ``optax.apply_if_finite``,
        ...).  Either one worker's state or the worker-stacked layout (a leading
        worker axis of ``n`` on every leaf, :mod:`compjax.parallel`).
      params: the parameters the state was built for, in the same layout as
        ``opt_state`` (one worker's, or worker-stacked with the same ``n``);
        e.g. the workers' local parameters.
      assignment: the ``assignment`` given to :func:`diloco`, if any.

    Returns:
      A tree like ``params``, every leaf of the same shape and dtype: the
      global model (worker-stacked if ``params`` is: each worker's slice is
      its copy of the global model).

    Raises:
      ValueError: ``opt_state`` holds no :class:`DilocoState` or more than one
        (e.g. ``optax.multi_transform`` over two ``diloco``: pass each
        ``DilocoState`` with the parameters it was built for); ``params`` does not match the state (not as many
        floating-point leaves as the state's global copy, or a leaf's shape
        differs, e.g. one worker's params with a worker-stacked state).

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of
      Language Models", 2023 (Algorithm 1).  Douillard et al., "Streaming
      DiLoCo with overlapping communication: Towards a Distributed Free
      Lunch", 2025 (Algorithm 2).

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> tx = optax.chain(cj.diloco(optax.sgd(0.1), sync_every=2, axis_name=None))
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> for _ in range(3):   # two inner steps and a sync, then one more inner step
      ...     updates, opt_state = tx.update({"w": jnp.ones(2)}, opt_state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> [round(float(x), 4) for x in params["w"]]   # the worker's local parameters
      [0.634, 0.634]
      >>> g = cj.diloco_global_params(opt_state, params)
      >>> [round(float(x), 4) for x in g["w"]]   # the global model, as of the sync after step 2
      [0.734, 0.734]
    """
    state = _find_diloco_state(opt_state)
    leaves, treedef = jax.tree.flatten(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    n_float = sum(_is_float_leaf(x) for x in leaves)
    n_global = sum(len(a) for a in state.anchor)
    if n_float != n_global or not state.anchor:
        raise ValueError(
            f"params must be the parameters opt_state was built for: params has {n_float} floating-point "
            f"leaves, the DilocoState's global copy {n_global}"
        )
    out = [jnp.array(x, copy=True) for x in leaves]
    for idx, anchor in zip(fragment_assignment(params, len(state.anchor), assignment), state.anchor):
        if len(idx) != len(anchor):
            raise ValueError(
                f"params must be the parameters opt_state was built for: their fragments hold "
                f"{len(idx)} and {len(anchor)} leaves"
            )
        for i, a in zip(idx, anchor):
            want = jnp.shape(leaves[i])
            if jnp.shape(a) != want:
                raise ValueError(
                    f"params{paths[i]} has shape {want}, the DilocoState's global copy {jnp.shape(a)}: params must "
                    "be the parameters opt_state was built for, in the same layout (one worker's, or worker-stacked)"
                )
            out[i] = jnp.array(a, dtype=out[i].dtype, copy=True)
    return jax.tree.unflatten(treedef, out)
