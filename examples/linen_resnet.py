"""A Flax Linen ResNet with BatchNorm and a ``TrainState``, trained on one device.

The program as a Flax user writes it (after the Flax ImageNet example): the
model, a ``TrainState`` carrying ``batch_stats``, a jitted ``train_step`` that
returns the new state and metrics.  ``linen_resnet_compjax.py`` runs the same
``train_step`` data-parallel with a compressor, changing a few lines of
:func:`train`.

Run: ``python -m examples.linen_resnet --steps 200`` (Fashion-MNIST).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from examples.data import batches, fashion_mnist


class ResNetBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a (projected) shortcut."""

    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)))
        y = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if x.shape != y.shape:
            x = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A small ResNet: a stem, one stage of blocks per entry of ``stages`` (width doubling), a linear head."""

    stages: tuple = (1, 1, 1)
    width: int = 16
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for i, blocks in enumerate(self.stages):
            for j in range(blocks):
                x = ResNetBlock(self.width * 2**i, strides=2 if i and not j else 1)(x, train)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


#: The default model of :func:`train`: three stages of one block, 16 to 64 channels.
RESNET = ResNet()


class TrainState(train_state.TrainState):
    batch_stats: Any


def create_state(model: nn.Module, tx: optax.GradientTransformation, image_shape: tuple, seed: int = 0):
    variables = model.init(jax.random.key(seed), jnp.zeros((1, *image_shape)), train=False)
    return TrainState.create(apply_fn=model.apply, params=variables["params"],
                             batch_stats=variables["batch_stats"], tx=tx)


@jax.jit
def train_step(state: TrainState, batch: dict):
    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, batch["image"],
                                         train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, (logits, updates)

    (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return state, {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def train(images, labels, *, steps=200, batch_size=64, lr=0.1, model=RESNET, seed=0):
    tx = optax.sgd(lr, momentum=0.9)
    state = create_state(model, tx, images.shape[1:], seed)
    history = []
    for batch in itertools.islice(batches(images, labels, batch_size, seed), steps):
        state, metrics = train_step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def main(argv=None, train=train):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--limit", type=int, default=None, help="use the first N training images")
    args = parser.parse_args(argv)
    images, labels = fashion_mnist(args.limit)
    _, history = train(images, labels, steps=args.steps)
    for i in range(0, len(history), max(1, len(history) // 10)):
        print(f"step {i + 1}: loss {history[i]['loss']:.3f}, train accuracy {history[i]['accuracy']:.3f}")
    return history


if __name__ == "__main__":
    main()
