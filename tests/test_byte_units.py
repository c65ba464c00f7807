"""One byte unit on every layout: ``payload_bytes`` is bytes per worker (slow-axis replica) over the slow link in
the step actually taken, with one entry per worker on a 1-D mesh, the replicated 2-D layout and the sharded one;
``cj.worker_bytes`` reads the compiled program's audit in the same unit (largest branch of each conditional); the
within-host all-reduce of a leaf held whole is labelled compjax's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel
from compjax.accounting import Collective

SLOW, FAST = 2, 4


def _loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"] - y) ** 2)


def _run(layout: str, tx, steps: int = 1):
    """``steps`` steps of ``tx`` on a layout; returns (mesh, the last state, the audit of the step)."""
    init = {"w1": jnp.ones((6, 16)) * 0.1, "w2": jnp.ones((16, 3)) * 0.1, "b": jnp.zeros(3)}
    if layout == "1d":
        mesh, kw, bkw = parallel.make_mesh(), {}, {}
        p, s = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    elif layout == "2d":
        mesh, kw, bkw = parallel.make_2d_mesh(SLOW, FAST), {"fast_axis": "fast"}, {"fast_axis": "fast"}
        p, s = parallel.replicate(init, mesh, **kw), parallel.init_worker_state(tx, init, mesh, **kw)
    else:
        mesh = parallel.make_2d_mesh(SLOW, FAST)
        specs = parallel.fsdp_specs(init, mesh, min_size=1)
        assert specs["b"] == jax.P()  # 3 does not divide by 4: held whole
        kw, bkw = {"specs": specs}, {"fast_axis": "fast"}
        p, s = parallel.replicate(init, mesh, **kw), parallel.init_worker_state(tx, init, mesh, **kw)
    step = parallel.data_parallel_step(_loss, tx, mesh, **kw)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        b = (rng.normal(size=(32, 6)).astype(np.float32), rng.normal(size=(32, 3)).astype(np.float32))
        b = parallel.shard_batch(b, mesh, **bkw)
        p, s, _ = step(p, s, b)
    return mesh, s, cj.audit_collectives(step, p, s, b)


@pytest.mark.parametrize("layout, workers", [("1d", 8), ("2d", SLOW), ("sharded", SLOW)])
@pytest.mark.parametrize("name", ["topk", pytest.param("identity", marks=pytest.mark.slow)])
def test_payload_bytes_has_one_entry_per_worker_and_equals_the_audit_in_that_unit(layout, workers, name):
    make = {"topk": lambda: cj.topk(0.25, axis_name="data"), "identity": lambda: cj.identity(axis_name="data")}
    mesh, s, ops = _run(layout, optax.chain(make[name](), optax.sgd(0.1)))
    sent = cj.payload_bytes(s)
    assert sent.shape == (workers,)
    assert len(set(sent.tolist())) == 1 and int(sent[0]) > 0
    assert cj.worker_bytes(ops, mesh) == int(sent[0])
    if layout != "1d":  # per device: a quarter of the worker's count crosses the slow link from each device
        assert cj.accounting.bytes_by_axes(ops, mesh)[("data",)] * FAST == int(sent[0])


def test_diloco_reads_zero_between_syncs_and_the_audit_counts_the_sync_branch_once():
    tx = cj.diloco(optax.sgd(0.1), sync_every=2, axis_name="data", compressor=cj.topk(0.25, axis_name="data"))
    mesh, s1, ops = _run("sharded", tx, steps=1)
    assert cj.payload_bytes(s1).tolist() == [0, 0]
    mesh, s2, ops = _run("sharded", tx, steps=2)
    sync = int(cj.payload_bytes(s2)[0])
    assert sync > 0 and cj.worker_bytes(ops, mesh) == sync
    assert any(op.branch for op in ops if op.issuer == "compjax")  # the exchange sits in a branch of a cond


def test_worker_bytes_takes_the_largest_branch_of_each_conditional():
    def op(nbytes, branch, groups=((0, 4), (1, 5), (2, 6), (3, 7))):
        return Collective("all-gather", (("u8", (nbytes,)),), nbytes, "ag", groups, ("x/compjax/gathered_mean/ag",),
                          "", branch)

    ops = [op(10, ()), op(100, (("c1", 0),)), op(30, (("c1", 1),)), op(7, (("c1", 1), ("c2", 0))),
           op(5, (("c3", 1),)), op(1, (), ((0, 1, 2, 3), (4, 5, 6, 7)))]  # the last runs inside a host
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    assert cj.worker_bytes(ops, mesh) == (10 + max(100, 30 + 7) + 5) * FAST
    assert cj.worker_bytes(ops) == 10 + 100 + 5 + 1
    with pytest.raises(ValueError, match="axis_name='model'"):
        cj.worker_bytes(ops, mesh, axis_name="model")


class _CountedScans(list):
    """A list that counts how many times it is iterated (worker_bytes scans its per-collective counts)."""

    scans = 0

    def __iter__(self):
        type(self).scans += 1
        return super().__iter__()


def test_worker_bytes_descends_only_into_the_conditionals_nested_under_each_branch(monkeypatch):
    """Nested conditionals under different parents (Streaming DiLoCo: each fragment's sync loop inside its own
    branch): each branch's total adds only the conditionals nested in it, so the scans of the collectives grow
    with the branches, not with the product of the conditionals at each depth."""
    def op(nbytes, branch):
        return Collective("all-gather", (("u8", (nbytes,)),), nbytes, "ag", None, ("x/compjax/gathered_mean/ag",),
                          "", branch)

    parents, depth = 8, 4
    ops = [op(1, ())]
    for p in range(parents):  # parent p: a chain of `depth` conditionals, p + d + 2 bytes at depth d, branch 0
        chain = ()
        for d in range(depth):
            chain += ((f"c{p}_{d}", 0),)
            ops.append(op(p + d + 2, chain))
        ops.append(op(1, ((f"c{p}_0", 1),)))  # the other branch of the outermost one: 1 byte
    want = 1 + sum(sum(p + d + 2 for d in range(depth)) for p in range(parents))
    real = cj.accounting._worker_counts
    monkeypatch.setattr(cj.accounting, "_worker_counts", lambda *a: _CountedScans(real(*a)))
    _CountedScans.scans = 0
    assert cj.worker_bytes(ops) == want
    branches = {op.branch[:i] for op in ops for i in range(len(op.branch) + 1)}
    assert _CountedScans.scans <= 2 * len(branches), _CountedScans.scans  # two scans per branch visited


def test_the_fast_axis_sum_of_a_whole_leaf_is_labelled_compjax():
    mesh, _, ops = _run("sharded", optax.chain(cj.topk(0.25, axis_name="data"), optax.sgd(0.1)))
    inside = [op for op in ops if cj.accounting.collective_axes(op, mesh) == ("fast",) and op.op == "all-reduce"]
    assert any(op.bytes >= 12 for op in inside)  # b's gradient (3 float32) summed over the host's devices
    assert cj.bytes_by_issuer(ops)["other"] == 0, cj.format_collectives(ops)


@pytest.mark.slow  # compiles and audits four fragments' steps (about 9 s)
def test_streaming_diloco_steps_match_the_branches_they_took():
    """Streaming DiLoCo: one conditional per fragment; each step's payload_bytes is the bytes of the branch that
    fired (branch_bytes), 0 between syncs; worker_bytes adds every fragment's sync (an upper bound)."""
    tx = cj.diloco(optax.sgd(0.1), sync_every=4, fragments=2, axis_name="data",
                   compressor=cj.topk(0.25, axis_name="data"))
    sent = []
    for steps in range(1, 5):
        mesh, s, ops = _run("sharded", tx, steps=steps)
        sent.append(int(cj.payload_bytes(s)[0]))
    per_branch = cj.accounting.branch_bytes(ops, mesh)
    assert () not in per_branch and len(per_branch) == 2
    assert sorted(b for b in sent if b) == sorted(per_branch.values())  # each fragment's sync, once a cycle
    assert sent.count(0) == 2 and cj.worker_bytes(ops, mesh) == sum(per_branch.values())
