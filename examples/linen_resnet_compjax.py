"""The Linen ResNet program of ``linen_resnet.py`` run data-parallel on every device with top-k compression.

Against the single-device :func:`examples.linen_resnet.train`, :func:`train`
adds the mesh and a compressor in front of the optimizer, then changes four
lines: the state gets the worker axis, ``train_step`` is wrapped by
``parallel.worker_step`` (BatchNorm statistics averaged over workers after each
step), the loop calls the wrapped step, and the metrics (one value per worker)
are averaged on the host.  ``train_step`` itself is imported unchanged.

Run: ``python -m examples.linen_resnet_compjax --steps 200`` (Fashion-MNIST; on
CPU set ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for 8 workers, with
``PJRT_NPROC=16`` beside it: see the docs' CPU notes).
"""

from __future__ import annotations

import itertools

import jax
import optax

import compjax as cj
from compjax import parallel
from examples.data import batches
from examples.linen_resnet import RESNET, create_state, main, train_step


def train(images, labels, *, steps=200, batch_size=64, lr=0.1, model=RESNET, seed=0):
    mesh = parallel.make_mesh()  # compjax: mesh
    tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.sgd(lr, momentum=0.9))  # compjax: compressor chain
    state = create_state(model, tx, images.shape[1:], seed)
    state = parallel.replicate(state, mesh)
    step = parallel.worker_step(train_step, mesh, average="batch_stats")
    history = []
    for batch in itertools.islice(batches(images, labels, batch_size, seed), steps):
        state, metrics = jax.block_until_ready(step(state, batch))
        history.append({k: float(v.mean()) for k, v in metrics.items()})
    return state, history


if __name__ == "__main__":
    main(train=train)
