"""Bad input fails early with a ValueError naming the parameter; a mismatched tree fails clearly."""

import jax.numpy as jnp
import pytest

import compjax as cj


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, float("nan"), "a", None])
def test_topk_ratio(ratio):
    with pytest.raises(ValueError, match="ratio"):
        cj.topk(ratio)


@pytest.mark.parametrize(
    "kwargs,name",
    [({"rank": 0}, "rank"), ({"rank": 1.5}, "rank"), ({"start_step": -1}, "start_step"),
     ({"min_compression_rate": -1.0}, "min_compression_rate")],
)
def test_powersgd_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        cj.powersgd(**kwargs)


@pytest.mark.parametrize("make", [lambda: cj.topk(0.5), lambda: cj.powersgd(1, min_compression_rate=0.0)])
def test_mismatched_tree_is_a_clear_error(make):
    tx = make()
    state = tx.init({"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        tx.update({"w": jnp.zeros((4, 1)), "b": jnp.zeros(3)}, state)  # would broadcast silently
    with pytest.raises(ValueError, match="structure"):
        tx.update({"w": jnp.zeros((4, 3))}, state)


def test_make_mesh_rejects_too_many_workers():
    with pytest.raises(ValueError, match="num_workers"):
        cj.parallel.make_mesh(10_000)


@pytest.mark.parametrize("make", [lambda: cj.topk(0.1), lambda: cj.randomk(0.1, key=0),
                                  lambda: cj.dgc(0.1, warmup_steps=4)])
def test_sparsifiers_accept_an_empty_tree(make):
    tx = make()
    out, state = tx.update({}, tx.init({}))
    assert out == {} and int(cj.payload_bytes(state)) == 0
