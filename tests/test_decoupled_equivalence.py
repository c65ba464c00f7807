"""Decoupled DiLoCo at full quorum with waiting learners equals cj.diloco run as one SPMD program (vmap).

Learners run in threads over the in-process transport with the same initial parameters, the same
per-worker data order and the same compressor as the SPMD run; the syncer merges each fragment once
every learner has sent it (no grace limit) and every learner waits for the merge (no overlap).
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import optax
import pytest

import compjax as cj
from compjax.decoupled import InProcessTransport, Learner, Syncer
from tests.helpers import AXIS
from tests.test_diloco import init_params, run_vmap, targets

N, LR = 3, 0.1


def compressor(name, axis_name):
    if name == "identity":
        return cj.identity(axis_name, skip_nonfinite=False)
    return cj.chunktopk(2, chunk=4, skip_nonfinite=False, axis_name=axis_name)


def train_step_for(inner):
    @jax.jit
    def train_step(params, inner_state, c):  # the loss 0.5 |θ - c|^2 of test_diloco: gradient θ - c
        grads = jax.tree.map(lambda x, y: x - y, params, c)
        updates, inner_state = inner.update(grads, inner_state, params)
        return optax.apply_updates(params, updates), inner_state, 0.0

    return train_step


def run_decoupled(steps, H, P, comp):
    """The asynchronous system on the data of ``targets(steps, N)``: the syncer and the learners after the run."""
    params0 = init_params()
    names = [f"learner{i}" for i in range(N)]
    transport = InProcessTransport(names)
    comp_tx = compressor(comp, None)  # one compressor, a state per learner; the syncer decodes with it
    syncer = Syncer(params0, learners=names, fragments=P, compressor=comp_tx)  # Nesterov outer, as cj.diloco's
    inner = optax.sgd(LR)
    step = train_step_for(inner)
    learners = [Learner(n, step, params0, inner.init(params0), transport, sync_every=H, fragments=P,
                        compressor=comp_tx, wait_for_merge=True, reply_timeout_s=30.0)
                for n in names]
    data = targets(steps, N)
    errors = []

    def work(i):
        try:
            for c in data:
                learners[i].step(jax.tree.map(lambda x: x[i], c), tokens=8)
            learners[i].finish()
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    stop = threading.Event()
    server = threading.Thread(target=syncer.serve, args=(transport, stop))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(N)]
    server.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    stop.set()
    server.join(timeout=10)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return syncer, learners


@pytest.mark.parametrize("comp", ["identity", pytest.param("chunktopk", marks=pytest.mark.slow)])
@pytest.mark.parametrize("P, H, steps", [(1, 2, 6), pytest.param(2, 4, 12, marks=pytest.mark.slow)],
                         ids=["diloco", "streaming"])
def test_full_quorum_without_overlap_equals_diloco_in_one_spmd_program(P, H, steps, comp):
    tx = cj.diloco(optax.sgd(LR), sync_every=H, fragments=P, compressor=compressor(comp, AXIS), axis_name=AXIS)
    hist, _, state = run_vmap(tx, steps, N)
    one = lambda tree: jax.tree.map(lambda x: np.asarray(x)[0], tree)
    want = cj.diloco_global_params(one(state), one(hist[-1]))

    syncer, learners = run_decoupled(steps, H, P, comp)

    syncs = steps // H
    assert syncer.versions() == [syncs] * P
    assert len(syncer.merges) == syncs * P and all(len(m[2]) == N for m in syncer.merges)
    assert not syncer.refused
    got = syncer.global_params()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Each learner's own parameters are the SPMD run's worker's, inner steps after the last merge included.
    for w, learner in enumerate(learners):
        for a, b in zip(jax.tree.leaves(learner.params), jax.tree.leaves(hist[-1])):
            np.testing.assert_allclose(a, b[w], rtol=1e-5, atol=1e-5)
        assert learner.stats.sends == [syncs] * P and learner.stats.delays == [[0] * syncs] * P
    if comp == "identity":  # float32 outer gradients: 4 bytes per entry of the fragment
        sizes = [sum(x.size for x in syncer.fragment_values(p)) for p in range(P)]
        assert learners[0].stats.bytes_sent == [4 * syncs * s for s in sizes]
