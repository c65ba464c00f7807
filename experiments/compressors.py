"""Command-line registry of compressors for the main job: name -> (options, builder).

Adding a compressor is one :func:`register` call: the argparse options it
takes and a builder ``(args, axis_name, **common) -> optax transformation``,
where ``common`` holds keyword arguments that every compjax factory takes
(``skip_nonfinite``, see :func:`build`): the builder hands them to its factory
unchanged.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NamedTuple

import optax

import compjax as cj


class Entry(NamedTuple):
    options: tuple  # ((flag, argparse kwargs), ...)
    build: Callable[..., optax.GradientTransformation]  # (args, axis_name, **common)
    describe: Callable[[argparse.Namespace], dict]
    momentum_inside: bool = False  # the compressor carries the momentum (DGC): the optimizer after it has none


REGISTRY: dict[str, Entry] = {}


def register(
    name: str, options: tuple, build: Callable, describe: Callable | None = None, *, momentum_inside: bool = False
) -> None:
    """Register ``name`` with its ``options`` ((flag, kwargs), ...) and ``build(args, axis_name, **common)``.

    ``build`` passes ``common`` (keyword arguments of every compjax factory,
    e.g. ``skip_nonfinite``) on to the compjax factory unchanged.

    ``momentum_inside``: the compressor applies ``args.momentum`` itself (DGC's
    momentum correction), so the main job chains a plain SGD after it.
    """
    if describe is None:
        keys = [flag.lstrip("-").replace("-", "_") for flag, _ in options]

        def describe(args, keys=keys):
            return {k: getattr(args, k) for k in keys}

    REGISTRY[name] = Entry(tuple(options), build, describe, momentum_inside)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--compressor`` and every registered compressor's options (deduplicated) to ``parser``."""
    parser.add_argument("--compressor", default="identity", choices=sorted(REGISTRY))
    seen = set()
    for entry in REGISTRY.values():
        for flag, kwargs in entry.options:
            if flag not in seen:
                seen.add(flag)
                parser.add_argument(flag, **kwargs)


def build(
    args: argparse.Namespace, axis_name: str | None, *, skip_nonfinite: bool = True
) -> tuple[optax.GradientTransformation, dict[str, Any]]:
    """The compressor chosen by ``args.compressor`` and a dict of the options it used.

    ``skip_nonfinite``: the compressor's own non-finite guard (every compjax
    factory's ``skip_nonfinite``); the main job turns it off with
    ``--no-skip-nonfinite``.
    """
    entry = REGISTRY[args.compressor]
    return entry.build(args, axis_name, skip_nonfinite=skip_nonfinite), entry.describe(args)


def momentum_inside(name: str) -> bool:
    """Whether compressor ``name`` carries the momentum itself (then the optimizer after it has none)."""
    return REGISTRY[name].momentum_inside


RATIO = ("--ratio", {"type": float, "default": 0.01, "help": "kept fraction per layer (topk, randomk, dgc)"})
SEED = ("--compressor-seed", {"type": int, "default": 0, "help": "seed of the compressor's randomness"})

register("identity", (), lambda a, ax, **kw: cj.identity(axis_name=ax, **kw))
register("topk", (RATIO,), lambda a, ax, **kw: cj.topk(a.ratio, axis_name=ax, **kw))
register(
    "randomk",
    (RATIO, SEED),
    lambda a, ax, **kw: cj.randomk(a.ratio, key=a.compressor_seed, axis_name=ax, **kw),
    lambda a: {"ratio": a.ratio},
)
register(
    "dgc",
    (
        RATIO,
        ("--nesterov", {"action": "store_true", "help": "DGC: Nesterov momentum correction"}),
        ("--clip-norm", {"type": float, "default": None, "help": "DGC: local clipping at clip_norm / sqrt(workers)"}),
        ("--sparsity-warmup-steps", {"type": int, "default": 0, "help": "DGC: steps of sparsity warm-up (4 stages)"}),
        ("--sample-ratio", {"type": float, "default": 0.01, "help": "DGC: fraction sampled for the threshold"}),
        ("--exact-topk", {"action": "store_true", "help": "DGC: exact top-k instead of the sampled threshold"}),
        ("--no-momentum-masking", {"action": "store_true", "help": "DGC: do not zero the momentum where sent"}),
        ("--dense-vectors", {"action": "store_true", "help": "DGC: send 1-D leaves dense (the authors' code)"}),
        SEED,
    ),
    lambda a, ax, **kw: cj.dgc(
        a.ratio, momentum=a.momentum, nesterov=a.nesterov, clip_norm=a.clip_norm,
        warmup_steps=a.sparsity_warmup_steps, sample_ratio=None if a.exact_topk else a.sample_ratio,
        momentum_masking=not a.no_momentum_masking, sparsify_vectors=not a.dense_vectors,
        key=a.compressor_seed, axis_name=ax, **kw,
    ),
    lambda a: {"ratio": a.ratio, "momentum": a.momentum, "nesterov": a.nesterov, "clip_norm": a.clip_norm,
               "sparsity_warmup_steps": a.sparsity_warmup_steps,
               "sample_ratio": None if a.exact_topk else a.sample_ratio,
               "momentum_masking": not a.no_momentum_masking, "sparsify_vectors": not a.dense_vectors},
    momentum_inside=True,
)
register(
    "powersgd",
    (
        ("--rank", {"type": int, "default": 2, "help": "PowerSGD rank"}),
        ("--start-step", {"type": int, "default": 0, "help": "PowerSGD: dense steps before compressing"}),
        ("--min-compression-rate", {"type": float, "default": 2.0, "help": "PowerSGD: compress a matrix above this rate"}),
        SEED,
    ),
    lambda a, ax, **kw: cj.powersgd(a.rank, start_step=a.start_step,
                                    min_compression_rate=a.min_compression_rate, key=a.compressor_seed,
                                    axis_name=ax, **kw),
    lambda a: {"rank": a.rank, "start_step": a.start_step, "min_compression_rate": a.min_compression_rate},
)

# Quantizers.
register("onebit", (), lambda a, ax, **kw: cj.onebit(axis_name=ax, **kw))
register(
    "twobit",
    (("--threshold", {"type": float, "default": 0.5, "help": "2-bit threshold (MXNet default 0.5)"}),),
    lambda a, ax, **kw: cj.twobit(a.threshold, axis_name=ax, **kw),
)
register(
    "terngrad",
    (("--clip-sigma", {"type": float, "default": 2.5, "help": "TernGrad clipping at c*sigma"}), SEED),
    lambda a, ax, **kw: cj.terngrad(key=a.compressor_seed, clip_sigma=a.clip_sigma, axis_name=ax, **kw),
    lambda a: {"clip_sigma": a.clip_sigma},
)
register(
    "qsgd",
    (("--levels", {"type": int, "default": 256, "help": "QSGD quantization levels s"}), SEED),
    lambda a, ax, **kw: cj.qsgd(a.levels, key=a.compressor_seed, axis_name=ax, **kw),
    lambda a: {"levels": a.levels},
)
register("signsgd", (), lambda a, ax, **kw: cj.signsgd(axis_name=ax, **kw))
register("e3m0", (), lambda a, ax, **kw: cj.e3m0(axis_name=ax, **kw))  # Streaming DiLoCo's 4-bit floats
register(
    "cast",
    (("--dtype", {"default": "bfloat16", "choices": ["bfloat16", "float16"], "help": "cast payload dtype"}),),
    lambda a, ax, **kw: cj.cast(a.dtype, axis_name=ax, **kw),
)

# Delayed Gradient Averaging: the average of step t - D arrives at step t; any compressor above carries it.
INNER = sorted(n for n in REGISTRY if not REGISTRY[n].momentum_inside)
register(
    "dga",
    (
        ("--delay", {"type": int, "default": 5, "help": "DGA: steps D before a gradient's average arrives"}),
        ("--inner", {"default": "identity", "choices": INNER,
                     "help": "DGA: the compressor of the delayed exchange (its own options apply)"}),
    ),
    lambda a, ax, **kw: cj.delayed_averaging(
        a.delay, axis_name=ax, compressor=REGISTRY[a.inner].build(a, ax, skip_nonfinite=False), **kw
    ),
    lambda a: {"delay": a.delay, "inner": a.inner, **REGISTRY[a.inner].describe(a)},
)
