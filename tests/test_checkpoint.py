"""Checkpoints: every transform resumes bit-exactly in a new process; mismatches are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import compjax as cj
from compjax import parallel
from compjax.checkpoint import Checkpointer, signature
from tests.registry import CASES

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # every case, 2 processes
def test_every_transform_resumes_bit_exact_in_a_new_process(tmp_path):
    """40 steps straight == 20 steps, save, restore in a new process, 20 more: parameters and state bitwise."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),  # the 2nd process compiles nothing
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    for what in ("straight", "resume"):
        subprocess.run([sys.executable, "-m", "tests.checkpoint_cases", what, str(tmp_path)], cwd=ROOT, env=env,
                       check=True, timeout=600)
    straight = json.loads((tmp_path / "straight.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert sorted(straight) == sorted(CASES)
    assert resumed == straight


def _state(tx, workers, params=None):
    mesh = parallel.make_mesh(workers)
    params = params or {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    return {"params": parallel.replicate(params, mesh), "opt_state": parallel.init_worker_state(tx, params, mesh)}


def test_restore_refuses_another_worker_count_or_compressor_naming_both(tmp_path):
    topk = optax.chain(cj.topk(0.5, axis_name="data"), optax.sgd(0.1, momentum=0.9))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, _state(topk, 8))
        with pytest.raises(ValueError, match=r"saved by 8 workers, but this run has 4 workers"):
            ckpt.restore(_state(topk, 4))
        powersgd = optax.chain(cj.powersgd(1, axis_name="data"), optax.sgd(0.1, momentum=0.9))
        with pytest.raises(ValueError, match=r"made of TopkState, TraceState.*this run's state is made of "
                                             r"PowerSGDState, TraceState"):
            ckpt.restore(_state(powersgd, 8))
        with pytest.raises(ValueError, match=r"leaf \S*\['w'\] is \[\[8, 4, 3\], 'float32'\] .* "
                                             r"but \[\[8, 5, 3\], 'float32'\]"):
            ckpt.restore(_state(topk, 8, {"w": jnp.ones((5, 3)), "b": jnp.zeros(3)}))
        restored, _ = ckpt.restore(_state(topk, 8))  # the matching target still restores
        assert type(restored["opt_state"][0]).__name__ == "TopkState"
        with pytest.raises(ValueError, match="newer than the latest checkpoint"):
            ckpt.save(3, _state(topk, 8))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(tmp_path / "empty").restore(_state(topk, 8))
    with pytest.raises(ValueError, match="max_to_keep must be >= 1"):
        Checkpointer(tmp_path, max_to_keep=0)


def test_signature_counts_workers_and_names_state_types():
    tx = cj.apply_if_finite(optax.chain(cj.dgc(0.5, axis_name="data"), optax.sgd(0.1)), axis_name="data")
    sig = signature(_state(tx, 8))
    assert sig["workers"] == 8
    assert sig["types"][:2] == ["ApplyIfFiniteState", "DgcState"]
    assert sig["leaves"]["['params']['w']"] == [[8, 4, 3], "float32"]


TINY = ["--compressor", "powersgd", "--rank", "2", "--epochs", "2", "--train-limit", "256", "--batch-size", "64",
        "--no-progress"]


@pytest.mark.slow  # two runs of the main job (about 30 s)
def test_main_job_resumes_bit_exact_and_refuses_another_run(tmp_path):
    """Stopped at step 3 (mid-epoch 1) and resumed from --checkpoint-dir == never stopped, records included."""
    from experiments import train

    straight = train.main(TINY + ["--out", str(tmp_path / "a.jsonl")])
    ckpt = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"]
    stopped = train.main(TINY + ckpt + ["--stop-after", "3", "--out", str(tmp_path / "b.jsonl")])
    assert stopped["steps"] == 3 and "summary" not in (tmp_path / "b.jsonl").read_text()
    assert Checkpointer(tmp_path / "ck").all_steps() == [2, 3]  # every 2 steps, and where it stopped
    resumed = train.main(TINY + ckpt + ["--out", str(tmp_path / "b.jsonl")])
    assert resumed["params_sha256"] == straight["params_sha256"]
    assert resumed["steps"] == straight["steps"] == 8
    drop = ("wall_s", "provenance")  # the provenance names each process's command and start time
    lines = [[{k: v for k, v in json.loads(line).items() if k not in drop}
              for line in (tmp_path / f).read_text().splitlines()] for f in ("a.jsonl", "b.jsonl")]
    assert lines[0] == lines[1]  # the epoch records and the summary, written across the two processes
    with pytest.raises(SystemExit, match=r"saved by 8 workers, but this run has 4 workers"):
        train.main(TINY + ckpt + ["--workers", "4", "--out", str(tmp_path / "c.jsonl")])
    with pytest.raises(SystemExit, match=r"the run differs from the checkpoint's \(lr: checkpoint 0.05, this run 0.1"):
        train.main(TINY + ckpt + ["--lr", "0.1", "--out", str(tmp_path / "c.jsonl")])


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint-every", "0", "--checkpoint-dir", "x"], "--checkpoint-every 0: must be >= 1"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--stop-after", "-1"], "--stop-after -1: must be >= 1"),
    (["--mesh", "2x"], "--mesh 2x: expected SLOWxFAST"),
    (["--mesh", "3x4"], r"--mesh 3x4: slow x fast = 3 x 4 = 12 devices, but only 8"),
    (["--mesh", "2x4", "--workers", "8"], "--workers and --mesh both set the workers"),
])
def test_bad_resume_and_mesh_flags_exit_with_one_line(argv, message):
    from experiments import train

    with pytest.raises(SystemExit, match=message):
        train.main(["--no-progress", *argv])


def test_restore_refuses_another_dtype_naming_the_leaf_and_both_dtypes(tmp_path):
    """A float32 checkpoint onto a bfloat16 target of the same shape: refused by name, not cast on the way in."""
    mesh = parallel.make_mesh(8)
    like = {"params": parallel.replicate({"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.zeros(3)}, mesh)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"params": parallel.replicate({"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}, mesh)})
        with pytest.raises(ValueError, match=r"leaf \['params'\]\['w'\] is \[\[8, 4, 3\], 'float32'\] .* "
                                             r"but \[\[8, 4, 3\], 'bfloat16'\]"):
            ckpt.restore(like)


def test_restore_of_a_missing_step_names_the_steps_there(tmp_path):
    """Asking for a step the directory does not hold: compjax's own message, with the steps it does hold."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, {"w": jnp.ones(3)})
        with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 5 in \S+ \(steps there: \[2\]\)"):
            ckpt.restore({"w": jnp.ones(3)}, step=5)
        state, _ = ckpt.restore({"w": jnp.ones(3)}, step=2)  # the step that is there restores
        assert state["w"].tolist() == [1.0] * 3


def test_extra_is_the_value_at_save_time(tmp_path, monkeypatch):
    """Saves are asynchronous: changing the extra dict (or a NumPy leaf) right after save() must not reach the
    checkpoint (the main job's progress dict moves on while the save is written).  The background JSON write is
    held until the caller has changed everything, so a missing copy fails every time, not by timing."""
    import threading

    import numpy as np
    import orbax.checkpoint as ocp

    release, held = threading.Event(), []
    write = ocp.JsonCheckpointHandler._save_fn

    async def held_write(self, x, directory):
        background = threading.current_thread() is not threading.main_thread()
        held.append(background and release.wait(timeout=120))  # never blocks the caller's own thread
        await write(self, x, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", held_write)
    ck = Checkpointer(tmp_path / "ck")
    progress = {"done": 2, "losses": [0.5, 0.25]}
    perm = np.arange(1000)
    ck.save(2, {"w": jnp.ones(3), "perm": perm}, extra={"progress": progress})
    progress["done"] = 3
    progress["losses"].append(0.125)
    perm[:] = 0
    release.set()
    state, extra = ck.restore({"w": jnp.ones(3), "perm": np.zeros(1000, perm.dtype)})
    assert held == [True]  # the meta item was written in the background, after the changes above
    assert extra["progress"] == {"done": 2, "losses": [0.5, 0.25]}
    np.testing.assert_array_equal(state["perm"], np.arange(1000))
    ck.close()


def test_restoring_a_worker_stacked_checkpoint_into_one_worker_names_the_worker_axis(tmp_path):
    """An NNX CNN saved worker-stacked by 8 workers, restored into the one-worker model (32 channels)."""
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 32, (3, 3), rngs=rngs)
            self.head = nnx.Linear(32, 10, rngs=rngs)

    model = CNN(nnx.Rngs(0))
    plain = nnx.state(model, nnx.Param)
    stacked_model = CNN(nnx.Rngs(0))
    parallel.nnx_replicate(parallel.make_mesh(8), stacked_model)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, nnx.state(stacked_model, nnx.Param))
        with pytest.raises(ValueError, match=r"is worker-stacked \(a leading worker axis of 8 on every array leaf, "
                                             r"e\.g\. .*kernel.*: \(8, 3, 3, 1, 32\) vs \(3, 3, 1, 32\)\), but this "
                                             r"run's state has no worker axis.*parallel\.replicate.*nnx_replicate"
                                             r".*unreplicate") as err:
            ckpt.restore(plain)
        assert "32 workers" not in str(err.value)
        restored, _ = ckpt.restore(nnx.state(stacked_model, nnx.Param))  # the worker-stacked target restores
        assert jax.tree.leaves(restored)[0].shape[0] == 8
