"""The transformer LM annotated for ``(data, fsdp, tensor)`` meshes (experiments/lm/sharded.py), and its own step.

The model is checked against its own invariants (parameter count, causality, the logical-axis rules giving
each kernel its mesh axes, dropout off = a deterministic function); its train step through
``parallel.worker_step`` is checked against the same program without compjax.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from experiments.lm import sharded as S

CFG = S.CONFIGS["tiny"]
#: The LM with one block for the step compared across two programs: one block holds every kind of parameter
#: and layout of the LM (the embedding gather, attention, MLP, LayerNorms, head); a second one repeats them,
#: and the blocks are unrolled, so it doubled the compiles (XLA's default code generation, the slowest).
ONE_BLOCK = dataclasses.replace(CFG, n_layers=1)


@pytest.fixture(scope="module")
def model():
    return S.init(CFG)


def test_parameter_count_matches_the_formula():
    """The module docstring's count, for the tiny size (read from the abstract model) and for the 8B shape."""
    assert sum(x.size for x in jax.tree.leaves(S.nnx.state(S.abstract(CFG), S.nnx.Param))) == S.num_params(CFG) == 21_312
    assert S.num_params(S.CONFIGS["8b"]) == 128_256 * 4096 * 2 + 2048 * 4096 + 32 * (
        4 * 4096**2 + 2 * 4096 * 14_336 + 4 * 4096) + 2 * 4096


def test_rules_map_logical_axes_to_mesh_axes():
    """embed -> fsdp, heads/mlp/vocab -> tensor, kv and seq whole: the annotations read under the rules."""
    specs = S.param_specs(CFG)
    block = specs["blocks"][0]
    assert block["attn"]["query"] == P("fsdp", "tensor", None)
    assert block["attn"]["out"] == P("tensor", None, "fsdp")
    assert block["wi"] == P("fsdp", "tensor") and block["wo"] == P("tensor", "fsdp")
    assert specs["tok_embed"]["embedding"] == P("tensor", "fsdp")
    assert specs["head"] == P("fsdp", "tensor") and specs["pos_embed"] == P(None, "fsdp")
    assert block["ln1"]["scale"] == P("fsdp")
    other = S.param_specs(CFG, rules=(("embed", None), ("heads", None), ("mlp", "fsdp"), ("vocab", None)))
    assert other["blocks"][0]["wi"] == P(None, "fsdp")


def test_specs_drop_axes_the_mesh_lacks_or_holds_once():
    """On a data x fsdp mesh (tensor of size 1) the tensor entries go: P('fsdp', 'tensor') -> P('fsdp', None)."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    specs = S.param_specs(CFG, mesh=mesh)
    assert specs["blocks"][0]["wi"] == P("fsdp", None)
    assert specs["tok_embed"]["embedding"] == P(None, "fsdp")


@pytest.mark.slow  # builds and runs the model eagerly (several seconds on 2 cores)
def test_logits_are_causal_and_dropout_off_is_deterministic(model):
    """Changing the last token leaves the logits of every earlier position unchanged (to 0); the loss without
    dropout does not depend on the key."""
    graphdef, params = model
    m = S.nnx.merge(graphdef, S.nnx.State(params))
    ids = np.arange(10, dtype=np.int32)[None] % CFG.vocab
    other = ids.copy()
    other[0, -1] = 7
    a, b = np.asarray(m(jnp.asarray(ids))), np.asarray(m(jnp.asarray(other)))
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
    assert np.abs(a[:, -1] - b[:, -1]).max() > 0
    windows = jnp.asarray(np.arange(2 * (CFG.seq_len + 1)).reshape(2, -1) % CFG.vocab, jnp.int32)
    l1 = S.loss_fn(graphdef, params, windows, jax.random.key(0), CFG)
    l2 = S.loss_fn(graphdef, params, windows, jax.random.key(1), CFG)
    assert float(l1) == float(l2) and abs(float(l1) - np.log(CFG.vocab)) < 0.1


@pytest.mark.slow  # builds and runs the model eagerly (several seconds on 2 cores)
def test_dropout_draws_from_the_key():
    """With dropout on, two keys give two losses; the same key the same loss."""
    import dataclasses

    cfg = dataclasses.replace(CFG, dropout=0.5)
    graphdef, params = S.init(cfg)
    windows = jnp.asarray(np.arange(2 * (cfg.seq_len + 1)).reshape(2, -1) % cfg.vocab, jnp.int32)
    l1, l1b, l2 = (float(S.loss_fn(graphdef, params, windows, jax.random.key(k), cfg)) for k in (0, 0, 1))
    assert l1 == l1b and l1 != l2


@pytest.mark.parametrize("bad,msg", [({"heads": 3}, "heads \\* head_dim"), ({"dropout": 1.0}, "dropout"),
                                     ({"n_layers": 0}, "n_layers")])
def test_config_refuses_bad_sizes(bad, msg):
    import dataclasses

    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(CFG, **bad)


@pytest.mark.slow  # builds and runs the model eagerly (several seconds on 2 cores)
def test_the_programs_own_step_trains_on_one_device(model):
    """The jitted step with its static config and donated state lowers the loss over a few steps."""
    graphdef, params = model
    tx = optax.adamw(1e-2)
    step = S.make_train_step(graphdef, tx)
    p, s = jax.tree.map(jnp.array, params), tx.init(params)
    windows = jnp.asarray(np.random.default_rng(0).integers(0, 4, size=(4, CFG.seq_len + 1)), jnp.int32)
    losses = []
    for _ in range(5):
        p, s, loss = step(p, s, windows, None, CFG)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses


def mesh3(shape=(2, 2, 2)):
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "fsdp", "tensor"))


def lm_losses(tx, *, through_compjax, steps, shape=(2, 2, 2), rows=16):
    """Per-step losses of the LM's own jitted step (in/out shardings from the rules, static config) on a
    ``data x fsdp x tensor`` mesh (the LM of one block, ``ONE_BLOCK``): alone on the whole batch, or through
    ``parallel.worker_step`` (the mean of the workers' losses: equal halves of the batch)."""
    from compjax import parallel

    mesh = mesh3(shape)
    graphdef, params = S.init(ONE_BLOCK)
    specs = S.param_specs(ONE_BLOCK, mesh=mesh)
    ps = S.shardings(mesh, specs)
    ss = S.shardings(mesh, parallel.state_specs(tx, params, specs, mesh))
    own = S.make_train_step(graphdef, tx, param_shardings=ps, opt_shardings=ss, donate=False)
    if through_compjax:
        p, s = parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh, specs=specs)
        step = parallel.worker_step(lambda p, s, b: own(p, s, b, None, ONE_BLOCK), mesh)
    else:
        p, s = jax.device_put(params, ps), jax.device_put(tx.init(params), ss)
        step = lambda p, s, b: own(p, s, b, None, ONE_BLOCK)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        starts = rng.integers(0, ONE_BLOCK.vocab, size=(rows, 1))  # counting sequences: learnable
        windows = ((starts + np.arange(ONE_BLOCK.seq_len + 1)) % ONE_BLOCK.vocab).astype(np.int32)
        p, s, loss = step(p, s, windows)
        losses.append(float(np.mean(np.asarray(loss))))
    return np.array(losses), p, s


@pytest.mark.slow  # two compiles of the LM on 2 x 2 x 2 and 40 steps (~30 s on 2 cores)
@pytest.mark.users_codegen  # 1e-6 between two programs: XLA's default fusions (the fast-compile ones: 1.2e-6)
def test_identity_through_the_programs_own_step_equals_the_program_without_compjax():
    """20 steps of cj.identity + AdamW through worker_step on data=2 x fsdp=2 x tensor=2, dropout off, equal
    the program's own step with AdamW alone on the whole batch (loss per step to 1e-6): the mean of two
    workers' gradients on equal halves is the whole batch's gradient."""
    import compjax as cj

    ref, _, _ = lm_losses(optax.adamw(1e-2), through_compjax=False, steps=20)
    got, p, _ = lm_losses(optax.chain(cj.identity(axis_name="data"), optax.adamw(1e-2)), through_compjax=True,
                          steps=20)
    assert ref[-1] < ref[0] - 0.05, ref  # it trains
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    assert p["blocks"][0]["wi"].sharding.spec == P("data", "fsdp", "tensor")


def test_the_dense_gradient_flag_counts_only_all_reduces_between_workers():
    """The audit's rule on a 2 hosts x 4 devices program: compjax's payload runs over groups (i, i + 4); a
    model-sized float all-reduce inside each host (XLA partitioning the worker's step) is not flagged, the same
    one between hosts is; without compjax groups to tell workers apart every all-reduce counts."""
    from compjax import accounting as acc

    grads = 4096
    ours = acc.Collective("all-reduce", (("f32", (256,)),), 1024, "ours",
                          replica_groups=((0, 4), (1, 5), (2, 6), (3, 7)), scopes=("jit(s)/compjax/dense_mean/psum",))
    inside = acc.Collective("all-reduce", (("f32", (2048,)),), 8192, "inside",
                            replica_groups=((0, 1, 2, 3), (4, 5, 6, 7)), scopes=("jit(s)/dot_general",))
    between = inside._replace(name="between", replica_groups=((0, 4), (1, 5), (2, 6), (3, 7)))
    assert [op.flag for op in acc._flag_dense_gradients([ours, inside], grads)] == ["", ""]
    assert [op.flag for op in acc._flag_dense_gradients([ours, inside, between], grads)] == [
        "", "", acc.DENSE_GRADIENTS]
    assert acc._flag_dense_gradients([inside], grads)[0].flag == acc.DENSE_GRADIENTS
    # a collective XLA's partitioner inserts inside compjax's scope (laying compjax's result out over a worker's
    # devices) is named after the op it partitions, not a collective: its groups do not tell workers apart
    layout = ours._replace(name="layout", op="all-gather", replica_groups=((0, 1, 2, 3), (4, 5, 6, 7)),
                           scopes=("jit(s)/compjax/gathered_mean/shard_map",))
    assert [op.flag for op in acc._flag_dense_gradients([ours, layout, inside, between], grads)] == [
        "", "", "", acc.DENSE_GRADIENTS]
    # compjax reducing inside a host too (chunk top-k's statistics): its groups no longer tell workers apart,
    # but the step's map of each device's worker (worker_step's worker_of_device) does
    stats = ours._replace(name="stats", replica_groups=((0, 1, 2, 3), (4, 5, 6, 7)))
    assert acc._flag_dense_gradients([ours, stats, inside], grads)[2].flag == acc.DENSE_GRADIENTS
    hosts = (0, 0, 0, 0, 1, 1, 1, 1)
    assert [op.flag for op in acc._flag_dense_gradients([ours, stats, inside, between], grads, hosts)] == [
        "", "", "", acc.DENSE_GRADIENTS]
    assert acc._flag_dense_gradients([ours, stats, inside], grads, hosts)[2].flag == ""


@pytest.mark.slow  # the LM's compile on 2 x 2 x 2 (~20 s on 2 cores)
def test_the_audit_of_the_lm_on_three_axes_does_not_warn_of_dense_gradients():
    """XLA's all-reduces inside each host (fsdp, tensor) carry more float bytes than the gradients, but none
    reaches the other host: no DENSE_GRADIENTS warning; compjax's all-reduces are the only ones between hosts."""
    import warnings

    import compjax as cj
    from compjax import parallel

    mesh = mesh3()
    graphdef, params = S.init(CFG)
    specs = S.param_specs(CFG, mesh=mesh)
    tx = optax.chain(cj.identity(axis_name="data"), optax.adamw(1e-3))
    own = S.make_train_step(graphdef, tx, donate=False)
    p, s = parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh, specs=specs)
    step = parallel.worker_step(own, mesh, static_argnums=4, batch_argnums=2)
    assert step.worker_of_device == (0, 0, 0, 0, 1, 1, 1, 1)
    windows = np.zeros((16, CFG.seq_len + 1), np.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = cj.audit_collectives(step, p, s, windows, None, CFG)
    assert not [w for w in caught if "densely" in str(w.message)]
    assert not [op for op in ops if op.flag]
    inside = sum(op.bytes for op in ops if op.op == "all-reduce" and op.issuer is None)
    assert inside > 4 * S.num_params(CFG)  # there is a lot inside the hosts
    hosts = lambda g: {d // 4 for d in g}
    assert all(len(hosts(g)) == 1 for op in ops if op.issuer is None and op.op != "collective-permute"
               for g in op.replica_groups)


@pytest.mark.parametrize("size", ["tiny", pytest.param("8b", marks=pytest.mark.slow)])  # 8B: ~5 s abstractly
def test_fragments_balanced_by_bytes_on_the_lm(size):
    """Streaming DiLoCo's split with assignment="bytes": on the LM (embedding and head each heavier than a
    block of the tiny size; 525M-parameter matrices against 218M-parameter blocks at 8B) the fragments' bytes
    lie within 25% of each other for 2, 3 and 4 fragments, where the strided rule alone leaves them 1.4x
    (8B, 3 fragments) to 162x (tiny, 4) apart; every leaf in one fragment; diloco takes it."""
    import compjax as cj
    from compjax.algorithms import fragment_assignment

    params = S.nnx.to_pure_dict(S.nnx.state(S.abstract(S.CONFIGS[size]), S.nnx.Param))
    leaves = jax.tree.leaves(params)
    nbytes = [int(np.prod(x.shape)) * 4 for x in leaves]
    for fragments in (2, 3, 4):
        frags = fragment_assignment(params, fragments, "bytes")
        assert sorted(i for f in frags for i in f) == list(range(len(leaves)))
        sizes = [sum(nbytes[i] for i in f) for f in frags]
        assert max(sizes) <= 1.25 * min(sizes), (fragments, sizes)
    strided = [sum(nbytes[i] for i in f) for f in fragment_assignment(params, 3)]
    assert max(strided) > 1.25 * min(strided)  # the default rule, unchanged
    if size == "tiny":
        tx = cj.diloco(optax.sgd(0.1), sync_every=4, fragments=3, assignment="bytes", axis_name=None)
        state = jax.eval_shape(tx.init, params)
        assert len(state.anchor) == 3
    with pytest.raises(ValueError, match="assignment must be 'bytes'"):
        fragment_assignment(params, 2, "size")
