"""Learners that are sharded programs: each on a 4-device fsdp mesh of its own, contributions shard by shard.

Two learners (devices 0-3 and 4-7 of the 8 simulated CPU devices) train an MLP with FSDP-sharded
parameters; their outer gradients leave shard by shard and the syncer merges per shard on the host.
At full quorum with waiting learners the global model equals cj.diloco on the 2 x 4 (data x fsdp)
mesh, and no learner array ever holds a whole parameter on one device.
"""

from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from compjax.decoupled import Contribution, Header, InProcessTransport
from compjax.decoupled.sharded import ShardedLearner, ShardedSyncer, ShardLayout

LR, H, STEPS, N, FAST = 0.1, 2, 4, 2, 4


def mlp_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def mlp(rng, d=16, h=32, o=8):
    return {"w1": (rng.normal(size=(d, h)) * 0.2).astype(np.float32), "b1": np.zeros(h, np.float32),
            "w2": (rng.normal(size=(h, o)) * 0.2).astype(np.float32), "b2": np.zeros(o, np.float32)}


def batches(rng, steps, rows):
    return [(rng.normal(size=(rows, 16)).astype(np.float32), rng.normal(size=(rows, 8)).astype(np.float32))
            for _ in range(steps)]


def not_whole(tree):
    """Every leaf's per-device shard is smaller than the leaf (no device holds a whole parameter)."""
    return all(x.sharding.shard_shape(x.shape) != x.shape for x in jax.tree.leaves(tree))


def test_shard_layout_splits_and_joins_and_gives_replicated_leaves_to_the_first_device():
    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    w = jax.device_put(np.arange(12, dtype=np.float32).reshape(4, 3), NamedSharding(mesh, P("fsdp")))
    b = jax.device_put(np.ones(3, np.float32), NamedSharding(mesh, P()))
    layout = ShardLayout.of({"b": b, "w": w})
    assert layout.shards == 2 and [len(o) for o in layout.owned] == [2, 1]  # b whole on shard 0 only
    values = [np.asarray(b), np.asarray(w)]
    pieces = layout.split(values)
    np.testing.assert_array_equal(pieces[1][0], np.asarray(w)[2:])
    for a, c in zip(layout.join(pieces), values):
        np.testing.assert_array_equal(a, c)
    with pytest.raises(ValueError, match="NamedSharding"):
        ShardLayout.of({"w": np.zeros(3, np.float32)})


def test_a_contribution_with_wrong_shard_fields_is_refused_and_changes_nothing():
    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    w = jax.device_put(np.zeros((4, 3), np.float32), NamedSharding(mesh, P("fsdp")))
    syncer = ShardedSyncer({"w": np.zeros((4, 3), np.float32)}, ShardLayout.of({"w": w}), learners=["a"],
                           outer=optax.sgd(1.0))
    for shard, shards in ((2, 2), (0, 3), ("1", 2)):
        h = Header("a", 0, 0, 1.0, 1, ((6,),), ("<f4",), 24, seq=1, shard=shard, shards=shards)
        replies = syncer.submit(Contribution(h, (np.ones(6, np.float32),)))
        assert [r.accepted for r in replies] == [False]
    assert syncer.versions() == [0, 0] and len(syncer.refused) == 3
    # The right fields: shard 1's syncer merges (quorum 1) and only shard 1 moves.
    h = Header("a", 0, 0, 1.0, 1, ((6,),), ("<f4",), 24, seq=1, shard=1, shards=2)
    (reply,) = syncer.submit(Contribution(h, (np.ones(6, np.float32),)))
    assert reply.accepted and reply.shard == 1 and syncer.versions() == [0, 1]
    np.testing.assert_array_equal(syncer.global_params()["w"], np.r_[np.zeros((2, 3)), -np.ones((2, 3))])


def run_sharded(params0, data):
    devices = jax.devices()
    meshes = [Mesh(np.array(devices[FAST * i:FAST * (i + 1)]).reshape(1, FAST), ("data", "fast")) for i in range(N)]
    specs = parallel.fsdp_specs(params0, meshes[0], min_size=1)
    inner = optax.sgd(LR)
    names = [f"dc{i}" for i in range(N)]
    transport = InProcessTransport(names)
    learners, layout = [], None
    for name, mesh in zip(names, meshes):
        p = parallel.replicate(params0, mesh, specs=specs)
        s = parallel.init_worker_state(inner, params0, mesh, specs=specs)
        step = parallel.data_parallel_step(mlp_loss, inner, mesh, specs=specs, independent=True)
        learners.append(ShardedLearner(name, step, p, s, transport, sync_every=H, wait_for_merge=True,
                                       reply_timeout_s=60.0))
        layout = learners[-1].layout
    syncer = ShardedSyncer(jax.tree.map(lambda x: x[None], params0), layout, learners=names)  # Nesterov 0.7, 0.9
    held_whole, errors = [], []

    def work(i):
        try:
            rows = len(data[0][0]) // N
            for x, y in data:
                b = parallel.shard_batch((x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]), meshes[i])
                learners[i].step(b, tokens=rows)
                held_whole.append(not not_whole(learners[i].params))
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
        t.join(timeout=120)
    stop.set()
    server.join(timeout=10)
    assert not errors, errors
    return syncer, learners, held_whole


def model_and_data():
    rng = np.random.default_rng(0)
    params0 = mlp(rng)
    return params0, batches(rng, STEPS, 8 * N * FAST)


def reference(params0, data):
    """cj.diloco's global parameters after the run, on the 2 x 4 (data x fsdp) mesh of this process."""
    mesh = parallel.make_2d_mesh(N, FAST)
    specs = parallel.fsdp_specs(params0, mesh, min_size=1)
    tx = cj.diloco(optax.sgd(LR), sync_every=H, axis_name="data")
    p, s = parallel.replicate(params0, mesh, specs=specs), parallel.init_worker_state(tx, params0, mesh, specs=specs)
    step = parallel.data_parallel_step(mlp_loss, tx, mesh, specs=specs)
    for b in data:
        p, s, _ = step(p, s, parallel.shard_batch(b, mesh, fast_axis="fast"))
    one = lambda tree: jax.tree.map(lambda x: np.asarray(x)[0], tree)
    return cj.diloco_global_params(one(s), one(p))


@pytest.mark.slow  # two 4-device learners and the 2 x 4 reference compile (several seconds on 2 cores)
def test_two_sharded_learners_at_full_quorum_equal_diloco_on_a_2x4_mesh_and_never_hold_a_whole_parameter():
    params0, data = model_and_data()
    want = reference(params0, data)

    syncer, learners, held_whole = run_sharded(params0, data)

    assert syncer.versions() == [STEPS // H] * FAST  # every shard merged at every sync
    assert all(len(m[2]) == N for sh in syncer.shards for m in sh.merges)
    got = jax.tree.map(lambda x: x[0], syncer.global_params())
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    for learner in learners:  # waiting learners hold the global model, still sharded
        for k in want:
            np.testing.assert_allclose(np.asarray(learner.params[k])[0], want[k], rtol=1e-5, atol=1e-5)
        assert not_whole(learner.params)
        assert all(len(a.devices()) == 1 for pieces in learner._anchor for a in pieces)
        assert learner.stats.sends == [STEPS // H]
        # Each send: the shards' float32 slices, together exactly the parameters' bytes.
        assert learner.stats.bytes_sent == [STEPS // H * 4 * sum(x.size for x in params0.values())]
    assert held_whole and not any(held_whole)


def test_the_whole_model_syncer_refuses_a_shard_s_contribution():
    from compjax.decoupled import Syncer

    syncer = Syncer({"w": np.zeros(4, np.float32)}, learners=["a"], outer=optax.sgd(1.0))
    h = Header("a", 0, 0, 1.0, 1, ((4,),), ("<f4",), 16, seq=1, shard=1, shards=2)
    (reply,) = syncer.submit(Contribution(h, (np.ones(4, np.float32),)))
    assert not reply.accepted and "ShardedSyncer" in reply.reason and syncer.versions() == [0]


@pytest.mark.slow  # three processes start, import JAX and compile (about a minute on 2 loaded cores)
def test_two_sharded_learner_processes_of_4_devices_equal_diloco_on_a_2x4_mesh(tmp_path):
    """The syncer and two learners as processes of 4 CPU devices each (MultiProcessTransport): every shard's
    contribution offered from its own device, replies per shard; equal cj.diloco on the 2 x 4 mesh to 1e-5, and
    neither learner ever held a whole parameter (nor an anchor piece) on one device."""
    pytest.importorskip("zmq")
    from tests.test_decoupled_multiprocess import Proc, free_address

    want = reference(*model_and_data())
    address = free_address()
    config = {"out": str(tmp_path), "steps": STEPS, "H": H, "n": N, "fast": FAST, "address": address,
              "learners": [f"dc{i}" for i in range(N)], "versions": STEPS // H,
              "runs": [{}]}
    procs = []
    try:
        syncer = Proc("sharded_syncer", config, tmp_path / "syncer.log", devices=FAST)
        procs.append(syncer)
        syncer.wait_for("syncer bound", "syncer start", timeout=240)
        for i in range(N):
            procs.append(Proc("sharded_learner", {**config, "name_self": f"dc{i}", "index": i},
                              tmp_path / f"learner{i}.log", devices=FAST))
        for p in procs[1:]:
            p.wait_for("done sharded", "training", timeout=300)
        syncer.wait_for("syncer done sharded", "syncer end", timeout=60)
    finally:
        for p in procs:
            p.stop()
    summary = json.loads((tmp_path / "sharded_syncer.json").read_text())
    assert summary["versions"] == [STEPS // H] * FAST and not any(summary["refused"])
    assert all(len(k) == N for merges in summary["merges"] for k in merges)
    got = np.load(tmp_path / "sharded_global.npz")
    names = sorted(want)  # the leaves in jax.tree order: b1, b2, w1, w2
    for j, k in enumerate(names):
        np.testing.assert_allclose(got[f"arr_{j}"][0], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    for i in range(N):
        stats = json.loads((tmp_path / f"sharded_learner_dc{i}.json").read_text())
        assert stats["devices"] == FAST and stats["whole"] == [] and stats["sends"] == [STEPS // H]
        mine = np.load(tmp_path / f"sharded_learner_dc{i}.npz")
        for j, k in enumerate(names):
            np.testing.assert_allclose(mine[f"arr_{j}"][0], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
