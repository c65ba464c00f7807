"""Global-norm clipping on every layout: cj.clip_by_global_norm equals optax's on whole leaves and takes the
whole model's norm on sharded parameters; norm-based optax transforms are found in a chain (before a compressor:
local clipping; under specs=: refused)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel
from compjax.compressors import clip
from tests.helpers import assert_same_params, replicated_and_sharded

SLOW, FAST = 2, 4


def np_clip(tree: dict, max_norm: float) -> dict:
    """Pascanu et al. 2013, Eq. 4: g <- g * max_norm / ||g|| when ||g|| > max_norm."""
    norm = np.sqrt(sum(np.sum(np.square(np.asarray(v, np.float64))) for v in tree.values()))
    scale = 1.0 if norm < max_norm else max_norm / norm
    return {k: np.asarray(v) * scale for k, v in tree.items()}


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_equals_the_numpy_rule_and_optax_on_one_device(max_norm):
    rng = np.random.default_rng(0)
    g = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), "b": jnp.asarray(rng.normal(size=3), jnp.float32)}
    tx = cj.clip_by_global_norm(max_norm)
    got = tx.update(g, tx.init(g))[0]
    ref = optax.clip_by_global_norm(max_norm)
    want = ref.update(g, ref.init(g))[0]
    for k in g:
        np.testing.assert_allclose(got[k], np_clip(g, max_norm)[k], rtol=1e-6)
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)


def test_bad_max_norm_is_refused():
    with pytest.raises(ValueError, match="max_norm"):
        cj.clip_by_global_norm(0.0)


def _loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def test_sharded_clipping_takes_the_whole_models_norm():
    """On a 2 x 4 mesh with every leaf but one sharded, three steps of topk -> cj.clip_by_global_norm -> SGD
    equal the replicated 2-D layout (the norm of whole layers), and the clip is active (its norm is well above
    max_norm: a shard's norm would clip less)."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    rng = np.random.default_rng(1)
    init = {"w1": jnp.asarray(rng.normal(size=(6, 16)), jnp.float32), "b1": jnp.zeros(16),
            "w2": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32), "b2": jnp.zeros(3)}
    specs = parallel.fsdp_specs(init, mesh, min_size=1)
    assert specs["b2"] == jax.P() and specs["w1"] != jax.P()
    tx = optax.chain(cj.topk(0.25, axis_name="data"), cj.clip_by_global_norm(0.05), optax.sgd(1.0))
    batches = [(rng.normal(size=(32, 6)).astype(np.float32), rng.normal(size=(32, 3)).astype(np.float32))
               for _ in range(3)]
    (rp, _), (sp, _), _ = replicated_and_sharded(_loss, tx, init, specs, batches, mesh)
    assert_same_params(sp, rp, FAST)
    want = parallel.gather(rp)
    step = np.sqrt(sum(np.sum((want[k][0] - np.asarray(init[k])) ** 2) for k in init))
    assert step <= 3 * 0.05 + 1e-5 and step > 0.05  # each of the 3 steps moved by exactly max_norm (clipped)


def test_norm_transforms_are_found_in_chains_and_wrappers():
    top = cj.topk(0.1, axis_name="data")
    before = optax.chain(optax.clip_by_global_norm(1.0), top, optax.adamw(1e-3))
    assert clip.local_norm_transforms(before) == ["clip_by_global_norm"]
    assert clip.local_norm_transforms(optax.chain(top, optax.clip_by_global_norm(1.0))) == []
    multi = optax.MultiSteps(before, 4).gradient_transformation()
    assert clip.local_norm_transforms(multi) == ["clip_by_global_norm"]
    inner = cj.diloco(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), sync_every=5,
                      axis_name="data")
    assert clip.local_norm_transforms(inner) == []  # DiLoCo's inner steps are local by design
    for tx, name in [(before, "clip_by_global_norm"), (optax.chain(top, optax.lamb(1e-3)), "scale_by_trust_ratio"),
                     (inner, "clip_by_global_norm"),
                     (optax.chain(top, optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=1.0)),
                      "clip_by_global_norm")]:
        with pytest.raises(ValueError, match=rf"optax\.{name}.*cj\.clip_by_global_norm"):
            clip.check_sharded_chain(tx)
    clip.check_sharded_chain(optax.chain(top, cj.clip_by_global_norm(1.0), optax.adamw(1e-3)))


def test_step_builders_warn_about_local_clipping_and_refuse_shard_norms():
    """A ported program's clip before the compressor is named at build time; under specs= optax's global norm
    (a shard's) is refused, cj.clip_by_global_norm is not; the NNX 2-D step does the same with optimizer.tx."""
    import warnings

    from flax import nnx

    mesh1 = parallel.make_mesh()
    before = optax.chain(optax.clip_by_global_norm(1.0), cj.topk(0.25, axis_name="data"), optax.sgd(0.1))
    with pytest.warns(UserWarning, match=r"optax\.clip_by_global_norm before its compjax compressor"):
        parallel.data_parallel_step(_loss, before, mesh1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.data_parallel_step(_loss, optax.chain(cj.topk(0.25, axis_name="data"),
                                                       optax.clip_by_global_norm(1.0)), mesh1)

    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = {"w1": jnp.zeros((6, 16)), "b1": jnp.zeros(16), "w2": jnp.zeros((16, 3)), "b2": jnp.zeros(3)}
    specs = parallel.fsdp_specs(init, mesh, min_size=1)
    after = optax.chain(cj.topk(0.25, axis_name="data"), optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"optax\.clip_by_global_norm.*shard's norm.*cj\.clip_by_global_norm"):
        parallel.data_parallel_step(_loss, after, mesh, specs=specs)
    parallel.data_parallel_step(_loss, optax.chain(cj.topk(0.25, axis_name="data"), cj.clip_by_global_norm(1.0)),
                                mesh, specs=specs)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 16, rngs=rngs)

        def __call__(self, x):
            return self.l1(x)

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, after, wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer, specs=parallel.fsdp_specs(nnx.state(model), mesh, min_size=1))
    step = parallel.nnx_data_parallel_step(lambda m, b: jnp.mean(m(b) ** 2), mesh, fast_axis="fast")
    with pytest.raises(ValueError, match=r"optax\.clip_by_global_norm"):
        step(model, optimizer, jnp.ones((16, 8)))


def test_a_chain_without_a_compressor_warns_unless_independent():
    """data_parallel_step and the NNX 2-D step with optax alone train one model per worker: said when built (or
    at the first call for NNX), silent with independent=True or with a compjax compressor in the chain."""
    import warnings

    from flax import nnx

    mesh1 = parallel.make_mesh()
    with pytest.warns(UserWarning, match=r"holds no compjax compressor.*independent=True"):
        parallel.data_parallel_step(_loss, optax.sgd(0.1), mesh1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.data_parallel_step(_loss, optax.sgd(0.1), mesh1, independent=True)
        parallel.data_parallel_step(_loss, optax.chain(cj.identity(axis_name="data"), optax.sgd(0.1)), mesh1)
        parallel.data_parallel_step(_loss, cj.diloco(optax.sgd(0.1), sync_every=4, axis_name="data"), mesh1)

    mesh = parallel.make_2d_mesh(SLOW, FAST)
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer)
    loss = lambda m, b: jnp.mean(m(b) ** 2)
    with pytest.warns(UserWarning, match=r"nnx_data_parallel_step: tx holds no compjax compressor"):
        parallel.nnx_data_parallel_step(loss, mesh, fast_axis="fast")(model, optimizer, jnp.ones((16, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.nnx_data_parallel_step(loss, mesh, fast_axis="fast", independent=True)(model, optimizer,
                                                                                        jnp.ones((16, 8)))
