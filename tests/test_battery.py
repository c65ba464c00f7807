"""The shared battery: every transform in tests/registry.py behaves like an optax citizen.

For each case, under ``jax.shard_map`` on 8 CPU workers unless stated:
optax's wrappers (``apply_if_finite``, ``MultiSteps``, ``inject_hyperparams``,
``multi_transform``) and user ``lax.cond``/``lax.switch`` give the unwrapped
result; a NaN on one worker leaves parameters and state unchanged on all
workers with the skip counter at 1; dtypes are kept and odd leaves pass
through; the state can be donated and holds no shared buffers; ``init`` runs
under ``jit``; the second step does not recompile; ``shard_map``, ``pmap`` and
``vmap`` agree; the same key gives the same result; ``payload_bytes`` equals
the compiled program's collectives; ``parallel.data_parallel_step`` (the step
builders' path through ``cj.apply_gradients``) gives what ``tx.update`` and
``optax.apply_updates`` give.  Every ``update`` gets ``params`` (DiLoCo needs them;
the compressors ignore them).  Transforms with local steps (``Case.local_steps``)
skip a non-finite step on the worker that saw it only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS
from tests.registry import CASES, FULL_ONLY, tiered

N = 8
STEPS = 3  # PowerSGD's dense first step and DGC's 2-step warm-up are both behind us by the last one
#: "big" is large enough for DGC's sampled threshold at ratio 0.01 (k = 100 of 10,000)
SHAPES = {"big": (100, 100), "dense": {"kernel": (16, 12), "bias": (12,)}}
NAMES = sorted(CASES)
#: The fast tier (``python -m pytest``) runs every case but those kept for the full tier (registry.FULL_ONLY)
#: in the cheapest test (dtypes, odd leaves and audited bytes), and each other test on one or two cases;
#: ``--all`` runs every case in every test.
FAST_NAMES = tuple(n for n in NAMES if n not in FULL_ONLY)
#: Copies of one transform in different compiled contexts (inside a wrapper's cond, say) may be fused
#: differently by XLA: equal up to float32 rounding, not bit for bit.
TOL = 1e-6


def is_shape(x):
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def zeros_params(shapes=SHAPES):
    return jax.tree.map(lambda s: jnp.zeros(s, jnp.float32), shapes, is_leaf=is_shape)


def local_grads(seed, n=N, shapes=SHAPES):
    """Per-worker gradients, stacked on a leading worker axis (NumPy float32)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.normal(size=(n, *s)).astype(np.float32), shapes, is_leaf=is_shape)


def per_worker(fn, mesh):
    """``jit(shard_map(fn))`` where ``fn`` sees one worker's slices and every input/output is worker-stacked."""

    def body(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def put(tree, mesh):
    return jax.device_put(tree, NamedSharding(mesh, P(AXIS)))


def stacked_init(tx, params, n=N):
    return jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tx.init(params))


def find(tree, cls):
    """The first node of type ``cls`` in a (wrapped) optax state."""
    hits = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls)) if isinstance(x, cls)]
    assert hits, f"no {cls.__name__} in the state"
    return hits[0]


def assert_trees_equal(a, b, atol=0.0, err=""):
    assert jax.tree.structure(a) == jax.tree.structure(b), err
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, err
        if atol:
            np.testing.assert_allclose(x, y, atol=atol, rtol=atol, err_msg=err)
        else:
            np.testing.assert_array_equal(x, y, err_msg=err)


def without(state, *fields):
    return state._replace(**{f: None for f in fields})


# --- optax wrappers, inject_hyperparams, multi_transform, user cond/switch ------------------------


# twobit: a traced value (its threshold) through the cheapest program; chunktopk's (~45 s to compile on 2 loaded
# cores, 8 copies of the exchange in one program) and the other cases in the full tier.
@pytest.mark.parametrize("name", tiered(NAMES, fast=("cast_bf16", "twobit")))
def test_wrappers_and_branches_equal_the_unwrapped_transform(mesh, name):
    case = CASES[name]
    params = zeros_params()
    sub_params = {"big": params["big"], "dense": {"kernel": params["dense"]["kernel"]}}
    labels = {"big": "c", "dense": {"kernel": "c", "bias": "z"}}
    inject = optax.inject_hyperparams(case.factory, static_args=case.static)
    txs = {
        "plain": case.make(AXIS),
        "optax.apply_if_finite": optax.apply_if_finite(case.make(AXIS), 3),
        "cj.apply_if_finite": cj.apply_if_finite(case.make(AXIS), axis_name=AXIS),
        "MultiSteps(k=1)": optax.MultiSteps(case.make(AXIS), 1).gradient_transformation(),
        "inject_hyperparams": inject(*case.args, axis_name=AXIS, **case.kwargs),
        "multi_transform": optax.multi_transform({"c": case.make(AXIS), "z": optax.set_to_zero()}, labels),
    }
    if case.traced:  # a traced hyperparameter with another value
        key, value = case.traced
        txs["plain, " + key] = case.make(AXIS, **{key: value})
        txs["inject_hyperparams, " + key] = inject(*case.args, axis_name=AXIS, **{**case.kwargs, key: value})
    sub = case.make(AXIS)  # the compressor on the sub-tree multi_transform gives it
    states = {k: tx.init(params) for k, tx in txs.items()} | {"sub": sub.init(sub_params)}
    states = jax.tree.map(lambda x: np.stack([np.asarray(x)] * N), states)

    # One program per variant, each compiled once and run on the state it updates (the user branches on the
    # plain one's): the same checks as one program holding them all, which XLA compiles in more time than the
    # parts together (DGC: 26 s for the 12 parts against 33 s for the whole, on 2 loaded cores).
    def update(tx, p):
        return lambda grads, state: tx.update(grads, state, p)

    def sub_update(grads, state):
        return sub.update({"big": grads["big"], "dense": {"kernel": grads["dense"]["kernel"]}}, state, sub_params)

    # User branches over the state, with a varying predicate (from the state) as DGA/DiLoCo use them.
    def branches(pick):
        def step(grads, s):
            run = lambda _: txs["plain"].update(grads, s, params)
            hold = lambda _: (jax.tree.map(jnp.zeros_like, grads), s)
            return pick(s, run, hold)
        return step

    programs = {k: (per_worker(update(tx, params), mesh), k) for k, tx in txs.items()} | {
        "sub": (per_worker(sub_update, mesh), "sub"),
        "cond(True)": (per_worker(branches(lambda s, run, hold: jax.lax.cond(s.count >= 0, run, hold, None)),
                                  mesh), "plain"),
        "cond(False)": (per_worker(branches(lambda s, run, hold: jax.lax.cond(s.count < 0, run, hold, None)),
                                   mesh), "plain"),
        "switch(1)": (per_worker(branches(lambda s, run, hold: jax.lax.switch(jnp.minimum(s.count, 0) + 1,
                                                                             [hold, run, hold], None)), mesh),
                      "plain"),
    }
    states = put(states, mesh)
    for t in range(STEPS):
        before = states
        grads = put(local_grads(seed=t), mesh)
        outs, states = {}, {}
        for k, (f, src) in programs.items():
            outs[k], states[k] = f(grads, before[src])
        outs, states = jax.block_until_ready((outs, states))
        ref, ref_state = outs["plain"], states["plain"]
        cls = type(ref_state)
        for k in ("optax.apply_if_finite", "cj.apply_if_finite", "MultiSteps(k=1)", "inject_hyperparams",
                  "cond(True)", "switch(1)"):
            assert_trees_equal(outs[k], ref, atol=TOL, err=f"{name}: {k}, step {t}")
            assert_trees_equal(find(states[k], cls), ref_state, atol=TOL, err=f"{name}: {k} state, step {t}")
        assert_trees_equal(outs["cond(False)"], jax.tree.map(np.zeros_like, ref))
        assert_trees_equal(states["cond(False)"], before["plain"])
        # multi_transform: the compressor sees the masked tree, the rest is zeroed.
        mt = outs["multi_transform"]
        assert_trees_equal({"big": mt["big"], "dense": {"kernel": mt["dense"]["kernel"]}}, outs["sub"], atol=TOL,
                           err=name)
        assert not np.any(np.asarray(mt["dense"]["bias"]))
        masked = jax.tree.leaves(find(states["multi_transform"], cls))  # MaskedNode where the bias was
        assert_trees_equal(masked, jax.tree.leaves(states["sub"]), atol=TOL, err=f"{name}: multi_transform")
        if case.traced:
            key = case.traced[0]
            assert_trees_equal(outs["inject_hyperparams, " + key], outs["plain, " + key], atol=TOL,
                               err=f"{name}: {key}")
    if case.traced:  # the other value mattered (by the last step: DGC's momentum acts from the second)
        assert not np.array_equal(outs["plain, " + key]["big"], ref["big"])


@pytest.mark.parametrize("name", tiered([n for n in NAMES if set(CASES[n].static) - {"dtype"}],
                                          fast=FAST_NAMES))
def test_inject_hyperparams_names_a_shape_argument_left_traced(name):
    """A numeric argument that fixes shapes (ratio, rank, levels) cannot be traced: the error says what to do."""
    case = CASES[name]
    tx = optax.inject_hyperparams(case.factory)(*case.args, axis_name=None, **case.kwargs)  # static_args forgotten
    params = zeros_params()
    state = tx.init(params)
    with pytest.raises(ValueError, match="static_args"):
        jax.eval_shape(tx.update, params, state)


# --- non-finite gradients on one worker ------------------------------------------------------------


@pytest.mark.parametrize("name", tiered(NAMES, fast=("identity",)))
def test_nan_on_one_worker_skips_the_step_on_every_worker(mesh, name):
    """With a vote, every worker skips; with local steps (DiLoCo), worker 3 alone, and the whole-chain guard
    (cj.apply_if_finite) still skips everywhere."""
    case = CASES[name]
    params = zeros_params()
    txs = {
        "compressor": optax.chain(case.make(AXIS), optax.sgd(0.1)),
        "whole chain": cj.apply_if_finite(optax.chain(case.make(AXIS), optax.sgd(0.1, momentum=0.9)),
                                          axis_name=AXIS),
    }

    def step(params, states, grads):
        out = {}
        for k, tx in txs.items():
            u, s = tx.update(grads, states[k], params[k])
            out[k] = (optax.apply_updates(params[k], u), s)
        return out

    f = per_worker(step, mesh)
    ps = put({k: jax.tree.map(lambda x: np.stack([np.asarray(x)] * N), params) for k in txs}, mesh)
    ss = put({k: stacked_init(tx, params) for k, tx in txs.items()}, mesh)
    out = jax.block_until_ready(f(ps, ss, put(local_grads(seed=0), mesh)))  # a finite step first
    ps, ss = {k: v[0] for k, v in out.items()}, {k: v[1] for k, v in out.items()}
    bad = local_grads(seed=1)
    bad["dense"]["kernel"][3, 2, 1] = np.nan  # worker 3 only
    new = jax.block_until_ready(f(ps, ss, put(bad, mesh)))
    cls = type(case.make(AXIS).init(params))
    c_old, c_new = find(ss["compressor"], cls), find(new["compressor"][1], cls)
    if case.local_steps:  # only worker 3 skips its (local) step; nothing non-finite anywhere
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(new["compressor"]))
        np.testing.assert_array_equal(np.asarray(c_new.skipped), [0, 0, 0, 1, 0, 0, 0, 0])
        np.testing.assert_array_equal(np.asarray(c_new.count), np.asarray(c_old.count) + 1)
        worker = lambda tree, w: jax.tree.map(lambda x: np.asarray(x)[w], tree)
        assert_trees_equal(worker(c_new.inner, 3), worker(c_old.inner, 3), err=f"{name}: worker 3's inner state")
        assert not np.array_equal(np.asarray(c_new.inner.inner_state[0].trace["big"])[0],
                                  np.asarray(c_old.inner.inner_state[0].trace["big"])[0])
    for k in txs:
        if case.local_steps and k == "compressor":
            continue
        assert_trees_equal(new[k][0], ps[k], err=f"{name}, {k}: parameters moved")
    if case.local_steps:
        return
    assert_trees_equal(without(c_new, "skipped", "payload_bytes"), without(c_old, "skipped", "payload_bytes"),
                       err=f"{name}: compressor state changed")
    assert np.all(np.asarray(c_new.skipped) == 1) and np.all(np.asarray(c_old.skipped) == 0)
    whole_old, whole_new = ss["whole chain"], new["whole chain"][1]
    assert_trees_equal(whole_new.inner_state, whole_old.inner_state, err=f"{name}: inner state changed")
    assert np.all(np.asarray(whole_new.total_notfinite) == 1)


# --- dtypes and odd leaves --------------------------------------------------------------------------

ODD = {
    "f32": ((6, 5), jnp.float32), "bf16": ((6, 5), jnp.bfloat16), "f16": ((40,), jnp.float16),
    "scalar": ((), jnp.float32), "empty": ((0, 4), jnp.float32), "int": ((3,), jnp.int32), "flag": ((), jnp.bool_),
}


@pytest.mark.parametrize("name", tiered(NAMES, fast=FAST_NAMES))
def test_dtypes_kept_odd_leaves_pass_through_and_bytes_are_audited(mesh, name):
    tx = CASES[name].make(AXIS, **CASES[name].one_path)
    params = {k: jnp.zeros(s, d) for k, (s, d) in ODD.items()}
    rng = np.random.default_rng(0)
    floats = {k: rng.normal(size=(N, *s)).astype(d) for k, (s, d) in ODD.items() if jnp.issubdtype(d, jnp.floating)}

    def step(fgrads, state):
        grads = {**fgrads, **{k: np.zeros(ODD[k][0], jax.dtypes.float0) for k in ("int", "flag")}}
        out, state = tx.update(grads, state, params)
        assert out["int"].dtype == out["flag"].dtype == jax.dtypes.float0
        return {k: out[k] for k in fgrads}, state

    f = per_worker(step, mesh)
    args = (put(floats, mesh), put(stacked_init(tx, params), mesh))
    ops = cj.audit_collectives(f, *args)
    out, state = jax.block_until_ready(f(*args))
    for k, x in floats.items():
        assert out[k].dtype == x.dtype and out[k].shape == x.shape, k
        assert np.all(np.isfinite(np.asarray(out[k], np.float32))), k
    np.testing.assert_array_equal(out["empty"], floats["empty"])
    for field in ("residual", "velocity", "accumulator"):
        tree = getattr(state, field, None)
        if tree is not None:
            assert {k: v.dtype for k, v in tree.items()} == {k: jnp.dtype(d) for k, (_, d) in ODD.items()}, field
    assert np.all(np.asarray(state.skipped) == 0)
    assert np.all(cj.payload_bytes(state) == sum(op.bytes for op in ops)), [(o.op, o.dtype, o.bytes) for o in ops]


# --- donation, init under jit, one compilation -------------------------------------------------------


@pytest.mark.parametrize("name", tiered(NAMES, fast=("identity",)))
def test_donation_init_under_jit_and_one_compilation(mesh, name):
    case = CASES[name]
    params = zeros_params()
    tx = case.make()
    state = tx.init(params)
    ptrs = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
    assert len(set(ptrs)) == len(ptrs), "two state leaves share a buffer"
    assert_trees_equal(jax.jit(tx.init)(params), state)
    update = jax.jit(tx.update, donate_argnums=1)
    for t in range(2):
        g = jax.tree.map(lambda x: x[0], local_grads(seed=t, n=1))
        out, state = jax.block_until_ready(update(g, state, params))
    assert update._cache_size() == 1
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(out))
    # The data-parallel step, donated, on 8 workers.
    tx = optax.chain(case.make(AXIS), optax.sgd(0.1, momentum=0.9))

    def loss_fn(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["big"][:16]) @ p["big"][:, :12]  # (batch, 12)
        return jnp.mean((h @ p["dense"]["kernel"].T + p["dense"]["bias"].sum() - y) ** 2)

    init = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), params)
    p, s = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    step = parallel.data_parallel_step(loss_fn, tx, mesh, donate=True)
    rng = np.random.default_rng(0)
    for _ in range(2):
        batch = parallel.shard_batch((rng.normal(size=(32, 16)).astype(np.float32),
                                      rng.normal(size=(32, 16)).astype(np.float32)), mesh)
        p, s, loss = jax.block_until_ready(step(p, s, batch))
    assert step._cache_size() == 1
    assert np.all(np.isfinite(np.asarray(loss)))


# --- backends and keys -------------------------------------------------------------------------------


def run_backend(tx, backend, mesh, steps=STEPS):
    state = stacked_init(tx, zeros_params())
    params = jax.tree.map(lambda x: np.stack([np.asarray(x)] * N), zeros_params())
    if backend == "shard_map":
        f = per_worker(tx.update, mesh)
        state, params = put(state, mesh), put(params, mesh)
    elif backend == "pmap":
        f = jax.pmap(tx.update, axis_name=AXIS)
    else:
        f = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
    outs = []
    for t in range(steps):
        g = local_grads(seed=10 + t)
        out, state = jax.block_until_ready(f(put(g, mesh) if backend == "shard_map" else g, state, params))
        outs.append(out)
    return jax.tree.map(np.asarray, (outs, state))


@pytest.mark.parametrize("name", tiered(NAMES, fast=("identity", "terngrad")))  # terngrad: keys
def test_backends_agree_and_keys_reproduce(mesh, name):
    case = CASES[name]
    results = {b: run_backend(case.make(AXIS), b, mesh) for b in ("shard_map", "pmap", "vmap")}
    for b in ("pmap", "vmap"):
        assert_trees_equal(results[b], results["shard_map"], atol=1e-6, err=f"{name}: {b} vs shard_map")
    again = run_backend(case.make(AXIS), "shard_map", mesh)
    assert_trees_equal(again, results["shard_map"], err=f"{name}: same key, another result")
    if case.random:
        other = run_backend(case.make(AXIS, key=4), "shard_map", mesh, steps=1)
        assert not np.array_equal(other[0][0]["big"], results["shard_map"][0][0]["big"])


@pytest.mark.parametrize("name", tiered([n for n in NAMES if "key" in CASES[n].kwargs] + ["powersgd"],
                                          fast=("terngrad",)))
def test_every_key_form_gives_the_same_result(name):
    case = CASES[name]
    params = zeros_params()
    g = jax.tree.map(lambda x: x[0], local_grads(seed=0, n=1))
    results = []
    for key in (3, jax.random.key(3), jax.random.PRNGKey(3), np.uint32([0, 3])):
        tx = case.make(key=key)
        out, _ = jax.jit(tx.update)(g, tx.init(params), params)
        results.append(jax.tree.map(np.asarray, out))
    for r in results[1:]:
        assert_trees_equal(r, results[0], err=name)


# --- the step builders users call ------------------------------------------------------------------------------


def linear_loss(params, grads):
    """``Σ <p, g>`` with ``g`` one worker's batch (the gradients with a leading 1): its gradient is ``g``."""
    return sum(jnp.sum(p * g[0]) for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads)))


@pytest.mark.parametrize("name", tiered(NAMES, fast=("topk",)))  # the full tier: every case
def test_data_parallel_step_equals_update_then_apply_updates(mesh, name):
    """``parallel.data_parallel_step`` (through ``cj.apply_gradients``, in place where the transform registers
    it) gives the parameters and state of ``tx.update`` then ``optax.apply_updates`` on each worker."""
    case = CASES[name]
    tx = case.make(AXIS)
    shapes = SHAPES if name == "dgc" else {"dense": SHAPES["dense"]}  # DGC's sampled threshold wants "big"
    init = jax.tree.map(lambda x: x + 0.5, zeros_params(shapes))

    def plain(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    ref = per_worker(plain, mesh)
    step = parallel.data_parallel_step(linear_loss, tx, mesh)
    params, state = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    want_params = put(jax.tree.map(lambda x: np.stack([np.asarray(x)] * N), init), mesh)
    want_state = put(stacked_init(tx, init), mesh)
    for t in range(STEPS):
        grads = local_grads(seed=t, shapes=shapes)
        params, state, _ = step(params, state, parallel.shard_batch(grads, mesh))
        want_params, want_state = ref(want_params, put(grads, mesh), want_state)
        assert_trees_equal(params, want_params, atol=1e-5, err=f"{name}: parameters, step {t + 1}")
        assert_trees_equal(state, want_state, atol=1e-5, err=f"{name}: state, step {t + 1}")
