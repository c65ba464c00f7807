"""DiLoCo's compiled step holds no avoidable copy: of the bfloat16 gradients in float32, or of the parameters.

The memory benchmark (``python -m experiments.benchmarks.memory``) measures the 8B model; these cases
check the same mechanisms on small models, from the compiled program (XLA:CPU's buffer assignment).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from tests.helpers import USERS_CODEGEN

#: Four stacked "blocks" of 4 layers of 256 x 256 and a head: 4.1 MiB of float32 parameters.
L, N = 4, 256


def _params():
    return {"blocks": [{"w": jnp.ones((L, N, N), jnp.float32)} for _ in range(4)], "head": jnp.ones((N, 64))}


def _temp_over_params(tx, grad_dtype) -> float:
    """Temporaries of the jitted ``update`` + ``apply_updates`` (state and parameters donated) over the parameters' bytes."""
    params = _params()
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, grad_dtype), params)
    state = tx.init(params)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile(USERS_CODEGEN)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    return compiled.memory_analysis().temp_size_in_bytes / param_bytes


@pytest.mark.parametrize("grad_dtype, bound", [(jnp.bfloat16, 2.0), (jnp.float32, 1.4)])
def test_inner_step_keeps_the_gradients_in_their_dtype(grad_dtype, bound):
    """The skip guard's loop reads bfloat16 gradients as they are: no float32 copy of them outside the loop.

    Measured: 1.75 (bfloat16 gradients) and 1.26 (float32) times the parameters' bytes; with the guard
    selecting the bfloat16 gradients as floats, XLA:CPU hoisted a float32 copy of them out of the loop
    (2.25); selecting float32 leaves through their bits kept copies of them (3.25).
    """
    tx = cj.diloco(optax.adamw(1e-3), sync_every=4, axis_name=None)
    ratio = _temp_over_params(tx, grad_dtype)
    assert ratio < bound, f"temporaries {ratio:.2f}x the parameters' bytes (bound {bound})"


def _small_sharded_step(tx):
    """A 2 x 4 mesh, parameters sharded over the fast axis: a scan over stacked layers reads them, as a model's does."""
    mesh = parallel.make_2d_mesh(2, 4)
    rng = np.random.default_rng(0)
    params = {"embed": rng.normal(size=(64, 128)).astype(np.float32),
              "layers": {"w": rng.normal(size=(4, 128, 128)).astype(np.float32) / 16,
                         "b": np.zeros((4, 128), np.float32)},
              "head": rng.normal(size=(128, 64)).astype(np.float32) / 16}

    def loss_fn(p, ids):
        x = p["embed"][ids[:, :-1]]

        def layer(x, w):
            return jnp.tanh(x @ w["w"].astype(jnp.bfloat16).astype(jnp.float32) + w["b"]), None

        x, _ = jax.lax.scan(layer, x, p["layers"])
        return optax.softmax_cross_entropy_with_integer_labels(x @ p["head"], ids[:, 1:]).mean()

    specs = parallel.fsdp_specs(params, mesh, fast_axis="fast", min_size=1)
    step = parallel.data_parallel_step(loss_fn, tx, mesh, axis_name="data", fast_axis="fast", specs=specs,
                                       donate=True)
    sspecs = parallel.state_specs(tx, params, specs, mesh)
    state = jax.eval_shape(tx.init, params)

    def structs(tree, tree_specs):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct((2, *x.shape), x.dtype,
                                                              sharding=NamedSharding(mesh, P("data", *tuple(s)))),
                            tree, tree_specs, is_leaf=lambda s: isinstance(s, P))

    batch = jax.ShapeDtypeStruct((8, 9), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fast"))))
    return step.lower(structs(params, specs), structs(state, sspecs), batch).compile(USERS_CODEGEN)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["streaming_diloco", "sparseloco"])
def test_sharded_step_copies_no_parameter(method):
    """The compiled sharded step writes the new parameters over the donated ones without copying them first.

    Streaming DiLoCo stores the outer gradient ``Δ = θ^g − (p + u)`` of a fragment that starts a
    synchronization; computed beside the parameter update, XLA ordered it after the update and kept a
    copy of every parameter leaf through the whole step (29 copies here; 7.1 GiB of temporaries for the
    8B model on a 2 x 4 mesh).
    """
    if method == "streaming_diloco":
        tx = cj.diloco(optax.adamw(1e-3), sync_every=4, fragments=2, overlap=1, alpha=0.5,
                       compressor=cj.e3m0(axis_name="data", skip_nonfinite=False), axis_name="data")
    else:
        tx = cj.sparseloco(optax.adamw(1e-3), sync_every=4, k=8, chunk=16, axis_name="data")
    text = _small_sharded_step(tx).as_text()
    copies = re.findall(r"= f32\[[0-9,]*\]\{[0-9,]*\} copy\(%param[.0-9]*\)", text)
    assert not copies, f"{len(copies)} parameters copied, e.g. {copies[:3]}"
