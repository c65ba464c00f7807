"""The LM matrix: every registered method through the transformer LM's own jitted step on three meshes.

For each method of the shared registry (tests/registry.py: every compressor, DiLoCo plain and Streaming
with fragments and overlap, SparseLoCo, DeMo, delayed averaging) chained before SGD, and each mesh
``data=2 x fsdp=4``, ``data=2 x fsdp=2 x tensor=2``, ``data=2 x tensor=4``, the LM of experiments/lm/sharded.py
(parameters laid out by its logical-axis rules) trains through ``parallel.worker_step`` with its own step:

* it compiles (no XLA abort) and steps;
* after three steps its parameters equal the same step on one device per worker (a 1-D mesh of two
  workers, parameters whole: the replicated layout) to 1e-5;
* the bytes one host's devices put into collectives reaching the other host (the compiled program's replica
  groups and collective-permute pairs, every issuer) equal ``payload_bytes``, read on the program of one
  path (the case's ``one_path`` arguments where it has several).

The LM has one block here (``n_layers=1``): one block holds every kind of parameter and every logical-axis rule
of the LM (the embedding looked up by a gather, attention, the MLP, LayerNorms, the output head), and Streaming
DiLoCo still finds more layers than fragments; a second block repeats them, and the blocks are unrolled, so each
block adds its share of every compile (the cases' time is XLA compiling: two blocks took about twice as long).

The full tier only: ~20-30 s per case on 2 cores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from registry import CASES, FULL_ONLY

import compjax as cj
from compjax import parallel
from experiments.lm import sharded as S
from tests.test_user_step_2d import cross_host

pytestmark = pytest.mark.slow

CFG = dataclasses.replace(S.CONFIGS["tiny"], n_layers=1)  # one block: see the module's docstring
MESHES = {"fsdp4": (2, 4, 1), "fsdp2_tensor2": (2, 2, 2), "tensor4": (2, 1, 4)}
STEPS = 3


def windows(steps=STEPS, rows=16, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        starts = rng.integers(0, CFG.vocab, size=(rows, 1))
        out.append(((starts + np.arange(CFG.seq_len + 1)) % CFG.vocab).astype(np.int32))
    return out


def run(tx, mesh, specs, data):
    graphdef, params = S.init(CFG)
    own = S.make_train_step(graphdef, tx, donate=False)
    p = parallel.replicate(params, mesh, specs=specs) if specs is not None else parallel.replicate(params, mesh)
    s = parallel.init_worker_state(tx, params, mesh, **({"specs": specs} if specs is not None else {}))
    step = parallel.worker_step(own, mesh, static_argnums=4, batch_argnums=2)
    compiled = step.lower(p, s, data[0], None, CFG).compile()
    for b in data:
        p, s, _ = step(p, s, b, None, CFG)
    return p, s, compiled


@functools.cache
def reference(name):
    """The replicated layout's parameters after the steps (gathered, NumPy) and its ``payload_bytes``: the same
    for every mesh, so each worker process computes it once per method."""
    make = lambda: optax.chain(CASES[name].make(axis_name="data"), optax.sgd(0.1))
    rp, rs, _ = run(make(), parallel.make_mesh(2), None, windows())
    return jax.tree.map(np.asarray, parallel.gather(rp)), int(cj.payload_bytes(rs)[0])


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(n for n in CASES if n not in FULL_ONLY))
def test_every_method_through_the_lms_own_step(name, mesh_name):
    case = CASES[name]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(MESHES[mesh_name]), ("data", "fsdp", "tensor"))
    specs = S.param_specs(CFG, mesh=mesh)
    make = lambda **kw: optax.chain(case.make(axis_name="data", **kw), optax.sgd(0.1))
    data = windows()

    p, s, compiled = run(make(), mesh, specs, data)
    want, ref_bytes = reference(name)
    got = parallel.gather(p)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5,
                                   err_msg=f"{name} {mesh_name} {jax.tree_util.keystr(path)}")
    assert int(cj.payload_bytes(s)[0]) >= ref_bytes > 0 or not ref_bytes

    if case.one_path:  # the bytes on the program of one path (the others hold every branch's collectives)
        p, s, compiled = run(make(**case.one_path), mesh, specs, data[:1])
    sent, crossing = cross_host(compiled, mesh)
    assert sent == int(cj.payload_bytes(s)[0]), (name, mesh_name, sent, int(cj.payload_bytes(s)[0]),
                                                 [(op.op, op.issuer, op.operands, n) for op, n in crossing])
