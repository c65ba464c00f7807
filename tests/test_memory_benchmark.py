"""The memory benchmark (experiments/benchmarks/memory.py) on a tiny transformer: sharded vs replicated bytes.

One run of the script's ``main`` (PowerSGD then AdamW, both layouts: two compiles from
abstract inputs on the 2 x 4 mesh) and one direct call of its ``measure``.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from compjax import parallel
from experiments.benchmarks import memory

pytestmark = pytest.mark.slow  # the full tier only (--all): its fixture runs the memory benchmark

FAST = memory.FAST
METHOD = "powersgd"  # its state (error-feedback residual, Q factors, AdamW moments) beside the parameters
#: Bytes the arguments may differ from the logical shards by: jit drops arguments the step does not read
#: (``keep_unused=False``: e.g. an 8-byte key), and XLA may round small buffers up.
SLACK = 1024
KEYS = ("argument", "output", "alias", "temp", "code", "peak", "params", "param_bytes", "state_bytes",
        "whole_state_bytes", "fits")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    res = memory.main(["--sizes", "tiny", "--methods", METHOD, "--out-dir", str(out)])
    peak = (out / "memory_peak.md").read_text()
    data = json.loads((out / "memory.json").read_text())
    assert peak == "\n".join(memory.summary(data["rows"])) + "\n" and "→" in peak  # the README's table
    return res, data, (out / "memory.md").read_text()


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def test_sharded_arguments_are_a_quarter(result):
    """Per device, the sharded step's arguments are the replicated ones' / fast (+5%), plus the leaves held whole."""
    _, data, _ = result
    by = {r["layout"]: r for r in data["rows"]}
    assert [(r["method"], r["layout"]) for r in data["rows"]] == [(METHOD, "replicated"), (METHOD, "sharded")]
    rep, sh = by["replicated"], by["sharded"]
    assert sh["whole_state_bytes"] > 0  # the tiny model has small leaves that stay whole
    assert sh["argument"] <= rep["argument"] / FAST * 1.05 + sh["whole_state_bytes"], (sh, rep)
    # and not less than a quarter of the parameters and state: nothing is left out of the arguments
    assert sh["argument"] >= (rep["param_bytes"] + rep["state_bytes"]) / FAST, (sh, rep)
    assert sh["peak"] < rep["peak"]
    assert [(t["method"], t["met"]) for t in memory.targets(data["rows"], size="tiny")] == [(METHOD, True)]


def test_replicated_arguments_are_the_whole_state(result):
    """Replicated: each device's arguments are one worker's whole parameters and state, plus its batch rows."""
    _, data, _ = result
    seq = memory.SIZES["tiny"]["seq_len"]
    for r in data["rows"]:
        if r["layout"] == "replicated":
            params, _ = memory.abstract_model("tiny")
            assert r["param_bytes"] == _nbytes(params)
            assert abs(r["argument"] - (r["param_bytes"] + r["state_bytes"] + (seq + 1) * 4)) <= SLACK, r
            assert r["param_bytes"] == 4 * memory.lm_model.num_params(memory.TINY_VOCAB, d_model=64, n_layers=2,
                                                                      n_heads=4, seq_len=seq)


def test_json_is_what_measure_computes(result):
    """The JSON and markdown hold the numbers ``measure`` returns (compiled here again), not stored ones."""
    res, data, md = result
    mesh = parallel.make_2d_mesh(memory.SLOW, memory.FAST)
    again = memory.measure("tiny", METHOD, "sharded", mesh)
    row = next(r for r in data["rows"] if r["layout"] == "sharded")
    assert {k: row[k] for k in KEYS} == {k: again[k] for k in KEYS}
    assert data["rows"] == json.loads(json.dumps(res["rows"]))
    # the per-device shards of the sharded state, from the specs: what the arguments hold besides the batch
    params, _ = memory.abstract_model("tiny")
    tx = memory.METHODS[METHOD](memory.AXIS)
    specs = parallel.fsdp_specs(params, mesh, fast_axis=memory.FAST_AXIS)
    sspecs = parallel.state_specs(tx, params, specs, mesh)
    state = jax.eval_shape(tx.init, params)

    def shard_bytes(tree, specs):
        leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize // (FAST if any(e is not None for e in s) else 1)
                   for x, s in zip(jax.tree.leaves(tree), leaves))

    seq = memory.SIZES["tiny"]["seq_len"]
    assert abs(again["argument"] - (shard_bytes(params, specs) + shard_bytes(state, sspecs) + (seq + 1) * 4)) <= SLACK
    for r in data["rows"]:
        assert f"| {r['size']} | {r['method']} | {r['layout']} | {r['argument'] / 2**30:,.2f} |" in md
        assert r["peak"] == r["argument"] + r["output"] - r["alias"] + r["temp"]
