"""Flax NNX models of the experiments, and their pure (graphdef, params) form for data-parallel steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class CNN(nnx.Module):
    """A small CNN for 28x28x1 images: conv16-pool-conv32-pool-dense128-dense10.

    8 parameter leaves, 206,922 float32 parameters (flax layout: conv kernels
    ``(3, 3, in, out)``, dense kernels ``(in, out)``).
    """

    def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.fc1 = nnx.Linear(7 * 7 * 32, 128, rngs=rngs)
        self.fc2 = nnx.Linear(128, num_classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.fc2(nnx.relu(self.fc1(x)))


def build(seed: int = 0, num_classes: int = 10):
    """The CNN as ``(params, apply, loss_fn)``.

    Returns:
      params: pytree of float32 arrays (flax layout: conv kernels (kh, kw, in, out)).
      apply: ``(params, x (B, 28, 28, 1)) -> logits (B, num_classes)``.
      loss_fn: ``(params, (x, y)) -> mean softmax cross-entropy`` (scalar).
    """
    model = CNN(num_classes, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)

    def apply(p, x):
        s = nnx.State(state)  # a fresh container per call: tracing never mutates the template
        nnx.replace_by_pure_dict(s, p)
        return nnx.merge(graphdef, s)(x)

    def loss_fn(p, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()

    return params, apply, loss_fn


def accuracy(apply, params, x, y, batch_size: int = 2000) -> float:
    """Top-1 accuracy of ``apply(params, .)`` on ``(x, y)``, evaluated in batches."""
    f = jax.jit(lambda p, xb: jnp.argmax(apply(p, xb), -1))
    correct = 0
    for i in range(0, len(x), batch_size):
        correct += int((jax.device_get(f(params, x[i:i + batch_size])) == y[i:i + batch_size]).sum())
    return correct / len(x)
