"""The memory benchmark (experiments/benchmarks/memory.py) on a tiny transformer: sharded vs replicated bytes,
the MaxText-style reference step, mixed precision, the plan of meshes and sizes, the targets and the table.

The tests marked slow run the script's ``main`` once (the reference, then PowerSGD and SparseLoCo in both
layouts: five compiles from abstract inputs on the 2 x 4 mesh) and call its ``measure`` directly; the others
only trace or read tables (fast tier).
"""

import json
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from experiments.benchmarks import memory

FAST = memory.FAST
METHOD = "powersgd"  # its state (error-feedback residual, Q factors, AdamW moments) beside the parameters
RUN_METHODS = ("sparseloco", METHOD)  # SparseLoCo: DiLoCo state + chunk top-k accumulators (METHODS' order)
#: Bytes the arguments may differ from the logical shards by: jit drops arguments the step does not read
#: (``keep_unused=False``: e.g. an 8-byte key), and XLA may round small buffers up.
SLACK = 1024
KEYS = ("argument", "output", "alias", "temp", "code", "peak", "params", "param_bytes", "state_bytes",
        "whole_state_bytes", "fits", "mesh", "precision")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    res = memory.main(["--sizes", "tiny", "--methods", ",".join(RUN_METHODS), "--out-dir", str(out)])
    peak = (out / "memory_peak.md").read_text()
    data = json.loads((out / "memory.json").read_text())
    # the sharded page's table and paragraph
    assert peak == "\n".join([*memory.summary(data["rows"]), "", memory.verdict(data)]) + "\n" and "×" in peak
    return res, data, (out / "memory.md").read_text()


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _shard_bytes(tree, specs):
    """Per-device bytes of ``tree`` laid out by ``specs`` (one fast axis of size FAST)."""
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize // (FAST if any(e is not None for e in s) else 1)
               for x, s in zip(jax.tree.leaves(tree), leaves))


@pytest.mark.slow
def test_sharded_arguments_are_a_quarter(result):
    """Per device, the sharded step's arguments are the replicated ones' / fast (+5%), plus the leaves held whole."""
    _, data, _ = result
    assert [(r["method"], r["layout"]) for r in data["rows"]] == [
        (memory.REFERENCE, memory.REFERENCE_LAYOUT), *((m, lay) for m in RUN_METHODS for lay in memory.LAYOUTS)]
    for method in RUN_METHODS:
        by = {r["layout"]: r for r in data["rows"] if r["method"] == method}
        rep, sh = by["replicated"], by["sharded"]
        assert sh["whole_state_bytes"] > 0  # the tiny model has small leaves that stay whole
        assert sh["argument"] <= rep["argument"] / FAST * 1.05 + sh["whole_state_bytes"], (sh, rep)
        # and not less than a quarter of the parameters and state: nothing is left out of the arguments
        assert sh["argument"] >= (rep["param_bytes"] + rep["state_bytes"]) / FAST, (sh, rep)
        assert sh["peak"] < rep["peak"]
    assert [(t["method"], t["met"]) for t in memory.targets(data["rows"], size="tiny")] == [
        (m, True) for m in RUN_METHODS]


@pytest.mark.slow
def test_replicated_arguments_are_the_whole_state(result):
    """Replicated: each device's arguments are one worker's whole float32 parameters and state, plus its batch
    rows (mixed precision keeps float32 master parameters and state)."""
    _, data, _ = result
    seq = memory.SIZES["tiny"]["seq_len"]
    rows = [r for r in data["rows"] if r["layout"] == "replicated"]
    assert len(rows) == len(RUN_METHODS) and {r["precision"] for r in data["rows"]} == {"mixed"}
    for r in rows:
        params, _ = memory.abstract_model("tiny")
        assert r["param_bytes"] == _nbytes(params)
        assert abs(r["argument"] - (r["param_bytes"] + r["state_bytes"] + (seq + 1) * 4)) <= SLACK, r
        assert r["param_bytes"] == 4 * memory.lm_model.num_params(memory.TINY_VOCAB, d_model=64, n_layers=2,
                                                                  n_heads=4, seq_len=seq)


@pytest.mark.slow
def test_json_is_what_measure_computes(result):
    """The JSON and markdown hold the numbers ``measure`` returns (compiled here again), not stored ones."""
    res, data, md = result
    mesh = parallel.make_2d_mesh(memory.SLOW, memory.FAST)
    again = memory.measure("tiny", METHOD, "sharded", mesh)
    row = next(r for r in data["rows"] if r["layout"] == "sharded" and r["method"] == METHOD)
    assert {k: row[k] for k in KEYS} == {k: again[k] for k in KEYS}
    assert data["rows"] == json.loads(json.dumps(res["rows"]))
    # the per-device shards of the sharded state, from the specs: what the arguments hold besides the batch
    params, _ = memory.abstract_model("tiny")
    tx = memory.METHODS[METHOD](memory.AXIS)
    specs = parallel.fsdp_specs(params, mesh, fast_axis=memory.FAST_AXIS)
    sspecs = parallel.state_specs(tx, params, specs, mesh)
    state = jax.eval_shape(tx.init, params)
    seq = memory.SIZES["tiny"]["seq_len"]
    assert abs(again["argument"] - (_shard_bytes(params, specs) + _shard_bytes(state, sspecs) + (seq + 1) * 4)) <= SLACK
    for r in data["rows"]:
        assert f"| {r['size']} | {r['mesh']} | {r['method']} | {r['layout']} | {r['argument'] / 2**30:,.2f} |" in md
        assert r["peak"] == r["argument"] + r["output"] - r["alias"] + r["temp"]


@pytest.mark.slow
def test_reference_step_is_fsdp_without_a_worker_axis(result):
    """The MaxText-style reference: one copy of the parameters and AdamW moments, each device a 1/fast shard
    (replicated over the slow axis), and its output written in place of its donated inputs."""
    _, data, _ = result
    ref = data["rows"][0]
    assert (ref["method"], ref["layout"], ref["mesh"]) == (memory.REFERENCE, memory.REFERENCE_LAYOUT, "2x4")
    mesh = parallel.make_2d_mesh(memory.SLOW, memory.FAST)
    params, _ = memory.abstract_model("tiny")
    tx = memory.optax.adamw(3e-4)
    specs = parallel.fsdp_specs(params, mesh, fast_axis=memory.FAST_AXIS)
    state = jax.eval_shape(tx.init, params)
    sspecs = parallel.state_specs(tx, params, specs, mesh)
    seq = memory.SIZES["tiny"]["seq_len"]
    assert abs(ref["argument"] - (_shard_bytes(params, specs) + _shard_bytes(state, sspecs) + (seq + 1) * 4)) <= SLACK
    assert ref["alias"] >= ref["argument"] - (seq + 1) * 4 - SLACK  # parameters and state updated in place
    assert ref["peak_vs_reference"] == 1.0


@pytest.mark.slow
def test_table_has_the_ratio_columns(result):
    """Every row's peak / reference and temporaries / arguments, in the JSON and the markdown table."""
    _, data, md = result
    assert "| peak / reference | temp / argument |" in md and "| fits 74.5 GiB |" in md
    ref = data["rows"][0]
    for r in data["rows"]:
        assert r["peak_vs_reference"] == pytest.approx(r["peak"] / ref["peak"], rel=1e-12)
        assert r["temp_vs_argument"] == pytest.approx(r["temp"] / r["argument"], rel=1e-12)
        assert (f"| {r['peak'] / 2**30:,.2f} | {'yes' if r['fits'] else 'no'} | {r['peak_vs_reference']:.2f} | "
                f"{r['temp_vs_argument']:.2f} |") in md
    assert memory.verdict(data) in md and "No target applies" in md  # the summary paragraph (none at tiny)


@pytest.mark.slow
def test_mixed_precision_keeps_float32_state():
    """``fp32`` and ``mixed`` take the same float32 arguments (master parameters, AdamW and compressor state);
    bfloat16 compute makes the mixed step's temporaries smaller."""
    mesh = parallel.make_2d_mesh(memory.SLOW, memory.FAST)
    rows = {p: memory.measure("tiny", "topk", "sharded", mesh, precision=p) for p in memory.PRECISIONS}
    assert rows["mixed"]["argument"] == rows["fp32"]["argument"]
    assert rows["mixed"]["state_bytes"] == rows["fp32"]["state_bytes"]
    assert rows["mixed"]["temp"] < rows["fp32"]["temp"], rows


def _dot_dtypes(precision):
    params, loss_fn = memory.abstract_model("tiny", precision)
    windows = jax.ShapeDtypeStruct((2, memory.SIZES["tiny"]["seq_len"] + 1), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(params, windows)
    dtypes = set()

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                dtypes.update(str(v.aval.dtype) for v in eqn.invars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    grads = jax.eval_shape(jax.grad(loss_fn), params, windows)
    return dtypes, {str(g.dtype) for g in jax.tree.leaves(grads)}, {str(p.dtype) for p in jax.tree.leaves(params)}


def test_mixed_precision_computes_in_bfloat16():
    """``mixed``: every matmul of the loss and its gradient takes bfloat16 operands, the master parameters are
    float32 and their gradients bfloat16 (``compute_cast``); ``fp32``: float32 throughout."""
    dots, grads, params = _dot_dtypes("mixed")
    assert dots == {"bfloat16"} and grads == {"bfloat16"} and params == {"float32"}
    dots, grads, params = _dot_dtypes("fp32")
    assert dots == {"float32"} and grads == {"float32"} and params == {"float32"}
    with pytest.raises(ValueError, match="precision"):
        memory.abstract_model("tiny", "bf16")


def test_plan_meshes_and_sizes():
    """The default run: 8B on 2 x 4 and 2 x 8 and on the data x fsdp x tensor meshes 2 x 2 x 2 and 2 x 4 x 2,
    every method sharded; 70B for dense, SparseLoCo and Streaming DiLoCo on 2 x 32 and 2 x 16 x 2: at most 64
    devices, which the script asks XLA for."""
    configs = memory.plan(list(memory.PLAN))
    by = {(s, m): (ms, lays) for s, m, ms, lays in configs}
    assert set(memory.METHODS) >= {"dense", "topk", "sparseloco", "powersgd", "dgc", "streaming_diloco"}
    for mesh in ((2, 4), (2, 8), (2, 2, 2), (2, 4, 2)):
        assert by[("8B", mesh)][0] == tuple(memory.METHODS) and "sharded" in by[("8B", mesh)][1]
    assert all("replicated" not in lays for _, mesh, _, lays in configs if len(mesh) == 3)
    big = [(m, ms) for s, m, ms, _ in configs if s == "70B"]
    assert [m for m, _ in big] == [(2, 32), (2, 16, 2)]
    assert all(set(ms) == {"dense", "sparseloco", "streaming_diloco"} for _, ms in big)
    assert max(math.prod(mesh) for _, mesh, _, _ in configs) == memory.MAX_DEVICES
    assert memory.plan(["8B"], ["dense"], [(2, 8)]) == [("8B", (2, 8), ("dense",), ("sharded",))]
    assert memory.plan(["8B"], ["dense"], [(2, 2, 2)]) == [("8B", (2, 2, 2), ("dense",), ("sharded",))]
    assert memory.plan(["tiny"]) == [("tiny", (memory.SLOW, memory.FAST), tuple(memory.METHODS), memory.LAYOUTS)]
    assert memory.parse_mesh("2x32") == (2, 32) and memory.parse_mesh("2x4x2") == (2, 4, 2)
    for bad in ("2x", "2x2x2x2", "2x0x2"):
        with pytest.raises(ValueError, match="SLOWxFAST or DATAxFSDPxTENSOR"):
            memory.parse_mesh(bad)


def test_70b_model_count_and_leaf_sizes():
    """The 70B class has 64,965,722,112 parameters (80 layers of d 8192), its leaves divide over the 70B mesh's
    fast axis (nothing held whole but the small leaves); top-k and DGC (flat int32 indices) are refused on its
    leaves of 2**31 elements or more, while every 8B leaf stays under 2**31."""
    params, _ = memory.abstract_model("70B")
    leaves = jax.tree.leaves(params)
    assert sum(int(np.prod(x.shape, dtype=np.int64)) for x in leaves) == 64_965_722_112
    eight, _ = memory.abstract_model("8B")
    assert max(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(eight)) < 2**31
    mesh = parallel.make_2d_mesh(memory.SLOW, memory.FAST)

    def no_step(*args, **kwargs):
        raise AssertionError("refused before any step is built")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory.parallel, "data_parallel_step", no_step)
        for method in memory.FLAT_INDEX_METHODS:
            with pytest.raises(ValueError, match="int32"):
                memory.measure("70B", method, "sharded", mesh)
    ((_, (slow, fast), _, _),) = memory.plan(["70B"], meshes=[(2, 32)])
    mesh = jax.sharding.AbstractMesh((slow, fast), (memory.AXIS, memory.FAST_AXIS))
    specs = jax.tree.leaves(parallel.fsdp_specs(params, mesh, fast_axis=memory.FAST_AXIS),
                            is_leaf=lambda x: isinstance(x, P))
    whole = [x for x, s in zip(leaves, specs) if all(e is None for e in tuple(s))]
    assert sum(int(np.prod(x.shape)) for x in whole) <= 2 * 8192, [x.shape for x in whole]


def _row(size, mesh, method, layout, argument, temp):
    return {"size": size, "mesh": mesh, "method": method, "layout": layout, "precision": "mixed", "params": 1,
            "argument": argument, "output": argument, "alias": argument, "temp": temp, "code": 0,
            "peak": argument + temp, "fits": argument + temp <= memory.DEVICE_BYTES, "lower_s": 0.0, "compile_s": 0.0}


def test_targets_and_verdict():
    """The issue's targets on made-up rows: 8B 2 x 4 fit, dense within 1.10x of the reference, temporaries
    <= 25% of arguments, 70B SparseLoCo and Streaming DiLoCo fit; the paragraph names what misses."""
    g = memory.GIB
    rows = memory.add_ratios([
        _row("8B", "2x4", memory.REFERENCE, memory.REFERENCE_LAYOUT, 22 * g, 5 * g),
        _row("8B", "2x4", "dense", "sharded", 22 * g, 5 * g),           # 27 GiB: 1.00x, temp 0.23
        _row("8B", "2x4", "topk", "sharded", 29 * g, 60 * g),           # 89 GiB: misses the fit and the temp
        _row("8B", "2x8", "topk", "sharded", 15 * g, 60 * g),           # another mesh: no 8B target
        _row("70B", "2x32", "sparseloco", "sharded", 38 * g, 9 * g),
        _row("70B", "2x32", "streaming_diloco", "sharded", 53 * g, 30 * g),  # 83 GiB: misses
        _row("70B", "2x32", "dense", "sharded", 23 * g, 300 * g),       # no 70B target for dense
    ])
    got = {(t["target"].split(" ", 1)[1], t["method"]): t["met"] for t in memory.targets(rows)}
    assert got == {
        ("sharded peak GiB <= 74.5", "dense"): True, ("sharded peak GiB <= 74.5", "topk"): False,
        ("dense sharded peak / reference peak <= 1.10", "dense"): True,
        ("sharded temporaries / arguments <= 0.25", "dense"): True,
        ("sharded temporaries / arguments <= 0.25", "topk"): False,
        ("sharded peak GiB <= 74.5", "sparseloco"): True, ("sharded peak GiB <= 74.5", "streaming_diloco"): False,
    }, got
    text = memory.verdict({"targets": memory.targets(rows), "precision": "mixed"})
    assert "4 of 7 met" in text and "topk on 2x4 (89.00)" in text and "streaming_diloco on 2x32 (83.00)" in text
    rows[1]["temp"] = 11 * g  # dense: 33 / 27 = 1.22x the reference
    rows[1]["peak"] = 33 * g
    rows = memory.add_ratios(rows)
    assert not next(t["met"] for t in memory.targets(rows) if "reference" in t["target"])
    short = "\n".join(memory.summary(rows))
    assert "| dense | 33.0 (1.22×) |" in short and "89.0 ✗ (3.30×)" in short


def test_reference_goes_with_its_layout():
    mesh = parallel.make_2d_mesh(memory.SLOW, memory.FAST)
    with pytest.raises(ValueError, match="layout"):
        memory.measure("tiny", memory.REFERENCE, "sharded", mesh)
    with pytest.raises(ValueError, match="layout"):
        memory.measure("tiny", "dense", memory.REFERENCE_LAYOUT, mesh)


def _fast_dims(spec) -> list[set]:
    """The mesh axes each dimension of ``spec`` is split over."""
    return [set(e if isinstance(e, tuple) else (e,)) - {None} for e in tuple(spec)]


def test_tensor_specs_follow_the_logical_rules():
    """On data=2 x fsdp=2 x tensor=2, every parameter is laid out as MaxText's rules map its logical axes (embed
    over fsdp; vocab, heads and mlp over tensor; positions and the stacked layers whole): each weight matrix
    (two dimensions besides the layers and positions) is split over both fast axes, none over the worker axis; each device holds a
    quarter of the parameters and of AdamW's moments (+5%: the biases over tensor only, AdamW's count)."""
    params, _ = memory.abstract_model("tiny")
    mesh = jax.sharding.AbstractMesh((2, 2, 2), (memory.AXIS, memory.FSDP_AXIS, memory.TENSOR_AXIS))
    specs = memory.tensor_specs(params, mesh)
    block = specs["blocks"][0]
    assert block["mlp"]["fc"]["kernel"] == P(None, "fsdp", "tensor")
    assert block["mlp"]["proj"]["kernel"] == P(None, "tensor", "fsdp")
    assert block["attn"]["qkv"]["kernel"] == P(None, "fsdp", "tensor") and block["ln1"]["scale"] == P(None, "fsdp")
    assert specs["tok_embed"]["embedding"] == P("tensor", "fsdp") and specs["head"]["kernel"] == P("fsdp", "tensor")
    rule = {"embed": {"fsdp"}, "vocab": {"tensor"}, "heads": {"tensor"}, "mlp": {"tensor"}, "seq": set(),
            "layers": set()}
    names = jax.tree.leaves(memory.logical_axes(), is_leaf=lambda x: isinstance(x, P))
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(names) == len(jax.tree.leaves(params))
    matrices = 0
    for name, spec in zip(names, leaves):
        dims = _fast_dims(spec)
        assert dims == [rule[n] for n in name], (name, spec)
        if sum(n not in ("layers", "seq") for n in name) == 2:  # a weight matrix (positions stay whole)
            matrices += 1
            assert set().union(*dims) == {"fsdp", "tensor"}, (name, spec)
    assert matrices == 2 + 4 * len(params["blocks"])  # embedding, head; qkv, proj, fc, proj of each stack
    tx = memory.METHODS["dense"](memory.AXIS)
    state = jax.eval_shape(tx.init, params)
    sspecs = parallel.state_specs(tx, params, specs, mesh)

    def per_device(tree, tree_specs):
        out = 0
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(tree_specs, is_leaf=lambda x: isinstance(x, P))):
            split = math.prod(mesh.shape[a] for d in _fast_dims(s) for a in d)
            out += int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize // split
        return out

    whole = _nbytes(params) + _nbytes(state)
    got = per_device(params, specs) + per_device(state, sspecs)
    assert whole / 4 < got <= whole / 4 * 1.05, (got, whole)
    with pytest.raises(ValueError, match=r"params\['.*dimension \d of size \d+ is sharded over \('tensor',\) of size 3"):
        memory.tensor_specs(params, jax.sharding.AbstractMesh((2, 2, 3), (memory.AXIS, memory.FSDP_AXIS,
                                                                           memory.TENSOR_AXIS)))


@pytest.mark.slow  # two compiles on data=2 x fsdp=2 x tensor=2 (~5 s)
def test_arguments_on_fsdp_x_tensor_are_a_quarter():
    """Compiled on data=2 x fsdp=2 x tensor=2: each device's arguments (parameters, AdamW moments, its batch rows)
    are those of the specs' shards, at most a quarter of one worker's whole parameters and state + 5%, for the
    MaxText-style reference and for data_parallel_step(specs=tensor_specs) alike."""
    mesh = memory.make_mesh((2, 2, 2))
    seq = memory.SIZES["tiny"]["seq_len"]
    for method, layout in ((memory.REFERENCE, memory.REFERENCE_LAYOUT), ("dense", "sharded")):
        row = memory.measure("tiny", method, layout, mesh)
        assert row["mesh"] == "2x2x2", row
        whole = row["param_bytes"] + row["state_bytes"]
        rows = 2 if layout == memory.REFERENCE_LAYOUT else 1  # the reference's batch is whole over tensor
        assert row["argument"] <= whole / 4 * 1.05 + rows * (seq + 1) * 4, (row, whole)
        assert row["argument"] >= whole / 4, (row, whole)
        assert row["alias"] >= row["argument"] - rows * (seq + 1) * 4 - SLACK  # updated in place
    with pytest.raises(ValueError, match="replicated"):
        memory.measure("tiny", "dense", "replicated", mesh)


@pytest.mark.slow  # three compiles on data=2 x fsdp=2 x tensor=2 (~10 s)
def test_dense_and_streaming_diloco_update_the_tensor_layout_where_it_lies():
    """On data=2 x fsdp=2 x tensor=2, dense and Streaming DiLoCo (E3M0) work on shards cut any way: their optimizer
    takes every leaf sharded over both fast axes as tensor_specs lays it out (``optimizer_view``), so the compiled
    step moves no parameter, gradient or state piece between devices of a host at the optimizer's boundary: the
    all-to-all and collective-permute bytes outside the loss (the loss's own are ``compjax_uncounted``) stay below
    one piece of the smallest such leaf (the re-layout of a LayerNorm or bias sharded over one of the two axes
    aside).  Top-k, whose optimizer sees one-dimensional shards, re-lays the parameters out there: more than their
    own bytes per device (each way, and the gradients)."""
    mesh = memory.make_mesh((2, 2, 2))
    params, _ = memory.abstract_model("tiny")
    specs = memory.tensor_specs(params, mesh)
    both = [x for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
            if set().union(*_fast_dims(s)) == {"fsdp", "tensor"}]
    smallest = min(int(np.prod(x.shape)) for x in both)  # float32 bytes of a quarter: one device's piece
    moved = {}
    for method in ("dense", "streaming_diloco", "topk"):
        built = memory.build("tiny", method, "sharded", mesh)
        view = memory.optimizer_view(params, specs, mesh, memory.METHODS[method](memory.AXIS))
        kept = sum(v == s for v, s in zip(*(jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, P))
                                            for t in (view, specs))))
        assert (kept >= len(both)) == (method != "topk"), (method, kept, len(both))
        compiled = built.step.lower(*built.inputs).compile(compiler_options=memory.compiler_options())
        moved[method] = sum(op.bytes for op in cj.audit_collectives(compiled)
                            if op.op in ("all-to-all", "collective-permute")
                            and not any("compjax_uncounted" in s for s in op.scopes))
    per_device = built.row["param_bytes"] // 4
    assert moved["dense"] < smallest and moved["streaming_diloco"] < smallest, (moved, smallest)
    assert moved["topk"] > per_device, (moved, per_device)
