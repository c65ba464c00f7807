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


def _shortcut_a(x, out_channels: int, stride: int):
    """He et al.'s option A: subsample by ``stride``, append zero channels up to ``out_channels``."""
    if stride > 1:
        x = x[:, ::stride, ::stride, :]
    extra = out_channels - x.shape[-1]
    if extra:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra)))
    return x


#: He et al. (2015)'s initialisation: N(0, 2 / fan_in), not truncated.
_HE_NORMAL = nnx.initializers.variance_scaling(2.0, "fan_in", "normal")


def _conv3x3(cin: int, cout: int, stride: int, rngs: nnx.Rngs) -> nnx.Conv:
    # Padding 1 on every side (not flax's "SAME", which pads (0, 1) at stride 2): output pixel i
    # is centred on input pixel stride * i, where the option-A shortcut samples.
    return nnx.Conv(cin, cout, kernel_size=(3, 3), strides=(stride, stride), padding=((1, 1), (1, 1)),
                    use_bias=False, kernel_init=_HE_NORMAL, rngs=rngs)


def _batch_norm(channels: int, rngs: nnx.Rngs) -> nnx.BatchNorm:
    return nnx.BatchNorm(channels, use_running_average=False, momentum=0.9, epsilon=1e-5, rngs=rngs)


class BasicBlock(nnx.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the option-A shortcut, then ReLU (He et al. 2016, Fig. 2)."""

    def __init__(self, cin: int, cout: int, stride: int, *, rngs: nnx.Rngs):
        self.out_channels = cout
        self.stride = stride
        self.conv1 = _conv3x3(cin, cout, stride, rngs)
        self.bn1 = _batch_norm(cout, rngs)
        self.conv2 = _conv3x3(cout, cout, 1, rngs)
        self.bn2 = _batch_norm(cout, rngs)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return nnx.relu(y + _shortcut_a(x, self.out_channels, self.stride))


class ResNet20(nnx.Module):
    """ResNet-20 for 32x32x3 images (He et al. 2016, Sec. 4.2, n = 3).

    conv3x3 16 - BN - ReLU; three stages of three :class:`BasicBlock` with 16,
    32 and 64 channels on 32x32, 16x16 and 8x8 maps (stride 2 in the first conv
    of stages 2 and 3); global average pool; dense ``num_classes``.  Shortcuts
    are option A: identity, subsampled by 2 and zero-padded with the new
    channels (appended after the existing ones) where the shape changes; they
    have no parameters.  Every conv is bias-free and followed by BatchNorm
    (scale and bias); conv kernels drawn from N(0, 2 / fan_in) (He et al. 2015),
    the dense layer flax's default.

    With 10 classes: 59 parameter leaves, 269,722 float32 parameters (19 conv
    kernels 267,696 + 19 BatchNorm scales and biases 2 x 688 + dense 650), plus
    38 BatchStat leaves (running means and variances, 1,376 floats) that are
    not parameters.

    BatchNorm always normalises with the statistics of the batch it is given
    (``use_running_average=False``), in training **and** in evaluation: see
    :func:`build`.  The running averages are updated on the module when it is
    called, but never used.

    Input ``(B, 32, 32, 3)`` float32; output logits ``(B, num_classes)``.

    References:
      He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition",
      CVPR 2016, Sec. 4.2.  He, Zhang, Ren & Sun, "Delving Deep into
      Rectifiers", ICCV 2015 (initialisation).  Ioffe & Szegedy, "Batch
      Normalization", ICML 2015.
    """

    def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs):
        self.conv = _conv3x3(3, 16, 1, rngs)
        self.bn = _batch_norm(16, rngs)
        blocks, cin = [], 16
        for cout, first_stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(BasicBlock(cin, cout, first_stride if i == 0 else 1, rngs=rngs))
                cin = cout
        self.blocks = nnx.List(blocks)
        self.fc = nnx.Linear(64, num_classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(axis=(1, 2)))


#: The models :func:`build` knows, by name.
MODELS = {"cnn": CNN, "resnet20": ResNet20}


def build(seed: int = 0, num_classes: int = 10, *, model: str = "cnn"):
    """A model of :data:`MODELS` as ``(params, apply, loss_fn)``.

    Args:
      seed: seeds the parameter initialisation (``nnx.Rngs(seed)``).
      num_classes: logits per example.
      model: ``"cnn"`` (:class:`CNN`, 28x28x1 inputs, the default) or
        ``"resnet20"`` (:class:`ResNet20`, 32x32x3 inputs).

    Returns:
      params: pytree of float32 arrays, only the ``nnx.Param`` leaves (flax
        layout: conv kernels (kh, kw, in, out)).
      apply: ``(params, x (B, H, W, C)) -> logits (B, num_classes)``; pure.
      loss_fn: ``(params, (x, y)) -> mean softmax cross-entropy`` (scalar).

    BatchNorm (ResNet-20): the training step is a pure function of ``params``,
    so ``apply`` normalises with the statistics of the batch it is given, in
    training and in :func:`accuracy` alike (evaluated in batches of 2000, so
    the statistics come from 2000 test images at a time); in a data-parallel
    step each worker normalises with its own shard's statistics (not
    synchronised across workers).  The running averages are never used:
    ``apply`` starts from the initial BatchStat values on every call and
    discards their updates.  This is a known approximation of the usual
    running-average evaluation: accuracy then depends (slightly) on the
    evaluation batch's size and composition, and a batch of one image is
    meaningless.

    Raises:
      ValueError: ``model`` is not a key of :data:`MODELS`.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got model={model!r}")
    net = MODELS[model](num_classes, rngs=nnx.Rngs(seed))
    graphdef, state, rest = nnx.split(net, nnx.Param, ...)  # rest: BatchStat leaves (empty for the CNN)
    params = nnx.to_pure_dict(state)
    rest_values = nnx.to_pure_dict(rest)

    def apply(p, x):
        # Fresh containers and Variables per call: tracing never mutates the template, and
        # BatchNorm's running-average updates land on this call's throw-away copy.
        s = nnx.State(state)
        nnx.replace_by_pure_dict(s, p)
        r = nnx.State(rest)
        nnx.replace_by_pure_dict(r, rest_values)
        return nnx.merge(graphdef, s, r)(x)

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
