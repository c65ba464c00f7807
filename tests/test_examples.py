"""The public-style Flax programs of examples/: each runs on one device, and data-parallel with compjax after a few lines change.

Linen: a ResNet with BatchNorm and a ``TrainState`` (``examples/linen_resnet.py``); NNX: a CNN with dropout and
``nnx.MultiMetric`` (``examples/nnx_cnn.py``).  Their ``*_compjax.py`` twins import the same ``train_step`` and
change :func:`train` only: the mesh and the compressor chain (lines marked ``# compjax: ...``) plus at most 6 lines.
"""

import difflib
import inspect

import jax
import numpy as np
import pytest
from flax import nnx

import compjax as cj
from compjax import parallel
from examples import linen_resnet, linen_resnet_compjax, nnx_cnn, nnx_cnn_compjax

N = 8
MARKS = ("# compjax: mesh", "# compjax: compressor chain")


def changed_lines(single, parallel_):
    """(added, removed) lines of ``parallel_.train`` against ``single.train``, the marked set-up lines aside."""
    a = inspect.getsource(single.train).splitlines()
    b = inspect.getsource(parallel_.train).splitlines()
    diff = [d for d in difflib.ndiff(a, b) if d[:2] in ("+ ", "- ")]
    added = [d for d in diff if d.startswith("+ ") and not d.rstrip().endswith(MARKS)]
    removed = [d for d in diff if d.startswith("- ") and not d[2:].strip().startswith("tx = ")]  # became the chain
    return added, removed


@pytest.mark.parametrize("single, parallel_", [(linen_resnet, linen_resnet_compjax), (nnx_cnn, nnx_cnn_compjax)])
def test_compjax_changes_at_most_six_lines_of_the_training_loop(single, parallel_):
    added, removed = changed_lines(single, parallel_)
    assert len(added) <= 6 and len(removed) <= len(added), (added, removed)
    src = inspect.getsource(parallel_.train)
    assert all(mark in src for mark in MARKS)
    assert parallel_.train_step is single.train_step  # the user's step, imported unchanged


def data(n=N * 4, size=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, size, size, 1)).astype(np.float32)
    return x, (x[:, : size // 2].mean(axis=(1, 2, 3)) > 0).astype(np.int32)


@pytest.mark.slow  # an example program
def test_linen_resnet_runs_data_parallel_with_batchnorm_averaged(mesh):
    x, y = data()
    model = linen_resnet.ResNet(stages=(1,), width=4, num_classes=2)
    state, history = linen_resnet_compjax.train(x, y, steps=2, batch_size=N * 2, model=model)
    assert len(history) == 2 and 0.0 <= history[-1]["accuracy"] <= 1.0  # accuracy from the step's logits
    leaves = jax.tree.leaves((state.params, state.batch_stats))
    for leaf in leaves:  # parameters kept equal by the compressor's mean, BatchNorm stats by average=
        arr = np.asarray(leaf)
        assert arr.shape[0] == N and (arr == arr[:1]).all()
    assert int(cj.payload_bytes(state.opt_state)[0]) > 0
    assert state.step.shape == (N,) and int(state.step[0]) == 2  # host reads work on what the step returns


@pytest.mark.slow  # an example program
def test_nnx_cnn_runs_data_parallel_with_metrics_and_its_own_masks(mesh):
    x, y = data()
    kwargs = {"width": 2, "hidden": 8, "num_classes": 2, "steps": 2, "batch_size": N * 2}
    model, history = nnx_cnn_compjax.train(x, y, **kwargs)
    assert len(history) == 2 and 0.0 <= history[-1]["accuracy"] <= 1.0
    params = nnx.state(model, nnx.Param)
    for leaf in jax.tree.leaves(params):
        arr = np.asarray(leaf)
        assert arr.shape[0] == N and (arr == arr[:1]).all()
    counts = np.asarray(nnx.state(model, nnx.RngCount)["dropout"]["rngs"]["count"][...])
    assert (counts == 2).all()  # one dropout draw per step on every worker (distinct masks: test_worker_step.py)
    # The eval of the one-device program takes one worker's copy; the stacked model itself has an extra axis.
    acc = nnx_cnn_compjax.evaluate(model, x, y)
    assert 0.0 <= acc <= 1.0 and acc == nnx_cnn.evaluate(parallel.nnx_unreplicate(model), x, y)
    with pytest.raises(ValueError, match="same number of dimensions"):  # the worker axis in every kernel
        nnx_cnn.evaluate(model, x, y)


@pytest.mark.slow  # an example program
def test_nnx_single_device_program_runs(mesh):
    x, y = data()
    _, history = nnx_cnn.train(x, y, width=2, hidden=8, num_classes=2, steps=2, batch_size=8)
    assert len(history) == 2 and np.isfinite(history[-1]["loss"])
