"""A program's own ``jax.jit`` step through ``parallel.worker_step``: its static arguments, its batch sharded over
the data axis, its donated state.

Programs write their step for the whole mesh: ``jax.jit(train_step, in_shardings=(..., NamedSharding(mesh,
P('data'))), static_argnums=..., donate_argnums=...)``.  worker_step reads those settings: the static
arguments pass through as they are, the data axis is taken out of the step's shardings (inside a worker it is
the worker axis itself), and the donated state is donated.
"""

import dataclasses
import functools

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

N = 2


@dataclasses.dataclass(frozen=True)
class Cfg:
    scale: float = 2.0


def init_params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3, jnp.float32)}


def batch():
    rng = np.random.default_rng(1)
    return rng.normal(size=(8, 4)).astype(np.float32)


TX = optax.chain(cj.identity(axis_name=AXIS), optax.sgd(0.1))


def train_step(params, opt_state, x, cfg):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2) * cfg.scale)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def state(mesh):
    params = init_params()
    return parallel.replicate(params, mesh), parallel.init_worker_state(TX, params, mesh)


def reference(mesh, cfg):
    """The same step with the config bound by functools.partial (no static argument, no shardings)."""
    p, s = state(mesh)
    return parallel.worker_step(jax.jit(functools.partial(train_step, cfg=cfg)), mesh)(p, s, batch())


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh(N)


def test_static_argnums_of_the_programs_jit_pass_through(mesh):
    """A config at static_argnums=(3,) of the step's own jit reaches it as it is (the loss scaled by it), and
    the default batch is the last argument that is not static."""
    step = parallel.worker_step(jax.jit(train_step, static_argnums=(3,)), mesh)
    p, s = state(mesh)
    got = step(p, s, batch(), Cfg(3.0))
    want = reference(mesh, Cfg(3.0))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[0]["w"]), np.asarray(want[0]["w"]), rtol=1e-6)


def test_static_argnums_given_to_worker_step_for_a_plain_function(mesh):
    """static_argnums= names them for a step that is not jitted; an unhashable one is refused by position."""
    step = parallel.worker_step(train_step, mesh, static_argnums=3)
    p, s = state(mesh)
    got = step(p, s, batch(), Cfg(3.0))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(reference(mesh, Cfg(3.0))[2]), rtol=1e-6)
    with pytest.raises(ValueError, match="argument 3 is static .* not hashable"):
        step(p, s, batch(), {"scale": 3.0})


def test_the_steps_batch_sharding_over_the_data_axis_is_translated(mesh):
    """in_shardings with the batch over P('data') (the program's layout over the whole mesh) gives the same
    numbers as the step without shardings: inside each worker the data axis is dropped from them."""
    whole = NamedSharding(mesh, P())
    step = jax.jit(train_step, static_argnums=(3,),
                   in_shardings=(whole, whole, NamedSharding(mesh, P(AXIS))), out_shardings=whole)
    p, s = state(mesh)
    got = parallel.worker_step(step, mesh)(p, s, batch(), Cfg())
    want = reference(mesh, Cfg())
    np.testing.assert_allclose(np.asarray(got[0]["w"]), np.asarray(want[0]["w"]), rtol=1e-6)


def test_a_constraint_over_the_worker_axis_inside_the_step_is_named(mesh):
    """A step of another kind that constrains to P('data') itself gets a ValueError naming the axis and the
    fix, not JAX's raw error."""

    def step(params, opt_state, x):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(AXIS)))
        return train_step(params, opt_state, x, Cfg())

    p, s = state(mesh)
    with pytest.raises(ValueError, match="shards something over the worker axis 'data'"):
        parallel.worker_step(step, mesh)(p, s, batch())


def test_the_programs_donate_argnums_are_honoured(mesh):
    """With donate_argnums=(0, 1) on the step's own jit the worker-stacked state is donated (the arrays held
    before the call are deleted, the compiled program aliases them); without, it is kept."""
    p, s = state(mesh)
    donating = parallel.worker_step(jax.jit(train_step, static_argnums=(3,), donate_argnums=(0, 1)), mesh)
    compiled = donating.lower(p, s, batch(), Cfg()).compile()
    assert "input_output_alias" in compiled.as_text()
    out = donating(p, s, batch(), Cfg())
    assert p["w"].is_deleted() and not out[0]["w"].is_deleted()
    p, s = state(mesh)
    keeping = parallel.worker_step(jax.jit(train_step, static_argnums=(3,), donate_argnums=(0,)), mesh)
    keeping(p, s, batch(), Cfg())  # only some of the state donated: nothing is
    assert not p["w"].is_deleted()
