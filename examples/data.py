"""Batches for the examples: shuffled mini-batches of (image, label) arrays, as a Flax tutorial would feed them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def batches(images: np.ndarray, labels: np.ndarray, batch_size: int, seed: int = 0) -> Iterator[dict]:
    """Endless shuffled batches ``{"image": float32 (b, H, W, C), "label": int32 (b,)}``, reshuffled every epoch."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(images))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i: i + batch_size]
            yield {"image": images[idx], "label": labels[idx]}


def fashion_mnist(limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's training split as ``float32 (n, 28, 28, 1)`` in [0, 1] and ``int32 (n,)`` labels."""
    from experiments.data import load_fashion_mnist

    x, y, _, _ = load_fashion_mnist()
    return x[:limit], y[:limit]
