"""A Flax NNX CNN with dropout and ``nnx.MultiMetric``, trained on one device.

The program as a Flax user writes it (after the Flax NNX MNIST tutorial):
``train_step(model, optimizer, metrics, batch)`` under ``nnx.jit`` takes the
gradient with ``has_aux`` (the logits feed the accuracy) and updates the
model, the optimizer and the metrics in place.  ``nnx_cnn_compjax.py`` runs the
same ``train_step`` data-parallel with a compressor, changing a few lines of
:func:`train`.

Run: ``python -m examples.nnx_cnn --steps 200`` (Fashion-MNIST).
"""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from examples.data import batches
from examples.linen_resnet import main as _main


class CNN(nnx.Module):
    """Two convolutions with average pooling, then a dropout MLP head."""

    def __init__(self, *, width: int = 32, hidden: int = 128, image_size: int = 28, num_classes: int = 10,
                 dropout: float = 0.25, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, width, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), rngs=rngs)
        self.pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * width * (image_size // 4) ** 2, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, num_classes, rngs=rngs)

    def __call__(self, x):
        x = self.pool(nnx.relu(self.conv1(x)))
        x = self.pool(nnx.relu(self.conv2(x)))
        x = self.dropout(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))
        return self.linear2(x)


def loss_fn(model: CNN, batch: dict):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch: dict):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def evaluate(model: CNN, images: np.ndarray, labels: np.ndarray, batch_size: int = 256) -> float:
    """Accuracy of a one-device model on ``images`` (dropout off for the evaluation, back on after)."""
    model.eval()
    correct = sum(int((np.asarray(model(jnp.asarray(images[i:i + batch_size]))).argmax(-1)
                       == labels[i:i + batch_size]).sum()) for i in range(0, len(images), batch_size))
    model.train()
    return correct / len(images)


def train(images, labels, *, steps=200, batch_size=64, lr=1e-3, seed=0, **model_kwargs):
    model = CNN(image_size=images.shape[1], rngs=nnx.Rngs(seed), **model_kwargs)
    tx = optax.adamw(lr)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    model.train()
    history = []
    for batch in itertools.islice(batches(images, labels, batch_size, seed), steps):
        train_step(model, optimizer, metrics, batch)
        history.append({k: float(v) for k, v in metrics.compute().items()})
        metrics.reset()
    return model, history


if __name__ == "__main__":
    _main(train=train)
