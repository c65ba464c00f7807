"""The NNX CNN program of ``nnx_cnn.py`` run data-parallel on every device with top-k compression.

Against the single-device :func:`examples.nnx_cnn.train`, :func:`train` adds
the mesh and a compressor in front of the optimizer, then changes four lines:
model, optimizer and metrics get the worker axis, ``train_step`` is wrapped by
``parallel.worker_step`` (each worker draws its own dropout masks from the
model's ``nnx.Rngs``), the loop calls the wrapped step, and the metrics (one
value per worker) are averaged on the host.  ``train_step`` itself is imported
unchanged.  The trained model is worker-stacked (a leading worker axis in every
Variable), so :func:`evaluate` hands the unchanged one-device eval
``parallel.nnx_unreplicate(model)``: one worker's copy, the model the
compressor's mean keeps equal on every worker.

Run: ``python -m examples.nnx_cnn_compjax --steps 200`` (Fashion-MNIST; on CPU
set ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for 8 workers, with
``PJRT_NPROC=16`` beside it: see the docs' CPU notes).
"""

from __future__ import annotations

import itertools

import jax
import optax
from flax import nnx

import compjax as cj
from compjax import parallel
from examples.data import batches
from examples.linen_resnet import main as _main
from examples.nnx_cnn import CNN, train_step
from examples.nnx_cnn import evaluate as evaluate_one


def train(images, labels, *, steps=200, batch_size=64, lr=1e-3, seed=0, **model_kwargs):
    mesh = parallel.make_mesh()  # compjax: mesh
    model = CNN(image_size=images.shape[1], rngs=nnx.Rngs(seed), **model_kwargs)
    tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.adamw(lr))  # compjax: compressor chain
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    model.train()
    parallel.nnx_replicate(mesh, model, optimizer, metrics)
    step = parallel.worker_step(train_step, mesh)
    history = []
    for batch in itertools.islice(batches(images, labels, batch_size, seed), steps):
        jax.block_until_ready(step(model, optimizer, metrics, batch))
        history.append({k: float(v.mean()) for k, v in metrics.compute().items()})
        metrics.reset()
    return model, history


def evaluate(model, images, labels, batch_size=256) -> float:  # compjax: one worker's copy of the model
    return evaluate_one(parallel.nnx_unreplicate(model), images, labels, batch_size)


if __name__ == "__main__":
    _main(train=train)
