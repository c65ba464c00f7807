"""Command-line registry of compressors for the main job: name -> (options, builder).

Adding a compressor is one :func:`register` call: the argparse options it
takes and a builder ``(args, axis_name) -> optax transformation``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NamedTuple

import optax

import compjax as cj


class Entry(NamedTuple):
    options: tuple  # ((flag, argparse kwargs), ...)
    build: Callable[[argparse.Namespace, str], optax.GradientTransformation]
    describe: Callable[[argparse.Namespace], dict]


REGISTRY: dict[str, Entry] = {}


def register(name: str, options: tuple, build: Callable, describe: Callable | None = None) -> None:
    """Register ``name`` with its ``options`` ((flag, kwargs), ...) and ``build(args, axis_name)``."""
    if describe is None:
        keys = [flag.lstrip("-").replace("-", "_") for flag, _ in options]

        def describe(args, keys=keys):
            return {k: getattr(args, k) for k in keys}

    REGISTRY[name] = Entry(tuple(options), build, describe)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--compressor`` and every registered compressor's options (deduplicated) to ``parser``."""
    parser.add_argument("--compressor", default="identity", choices=sorted(REGISTRY))
    seen = set()
    for entry in REGISTRY.values():
        for flag, kwargs in entry.options:
            if flag not in seen:
                seen.add(flag)
                parser.add_argument(flag, **kwargs)


def build(args: argparse.Namespace, axis_name: str) -> tuple[optax.GradientTransformation, dict[str, Any]]:
    """The compressor chosen by ``args.compressor`` and a dict of the options it used."""
    entry = REGISTRY[args.compressor]
    return entry.build(args, axis_name), entry.describe(args)


RATIO = ("--ratio", {"type": float, "default": 0.01, "help": "kept fraction per layer (topk, randomk, dgc)"})
SEED = ("--compressor-seed", {"type": int, "default": 0, "help": "seed of the compressor's randomness"})

register("identity", (), lambda a, ax: cj.identity(axis_name=ax))
register("topk", (RATIO,), lambda a, ax: cj.topk(a.ratio, axis_name=ax))
register(
    "powersgd",
    (
        ("--rank", {"type": int, "default": 2, "help": "PowerSGD rank"}),
        ("--start-step", {"type": int, "default": 0, "help": "PowerSGD: dense steps before compressing"}),
        ("--min-compression-rate", {"type": float, "default": 2.0, "help": "PowerSGD: compress a matrix above this rate"}),
        SEED,
    ),
    lambda a, ax: cj.powersgd(a.rank, start_step=a.start_step, min_compression_rate=a.min_compression_rate,
                              key=a.compressor_seed, axis_name=ax),
    lambda a: {"rank": a.rank, "start_step": a.start_step, "min_compression_rate": a.min_compression_rate},
)

# Quantizers (issue 3).
register("onebit", (), lambda a, ax: cj.onebit(axis_name=ax))
register(
    "twobit",
    (("--threshold", {"type": float, "default": 0.5, "help": "2-bit threshold (MXNet default 0.5)"}),),
    lambda a, ax: cj.twobit(a.threshold, axis_name=ax),
)
register(
    "terngrad",
    (("--clip-sigma", {"type": float, "default": 2.5, "help": "TernGrad clipping at c*sigma"}), SEED),
    lambda a, ax: cj.terngrad(key=a.compressor_seed, clip_sigma=a.clip_sigma, axis_name=ax),
    lambda a: {"clip_sigma": a.clip_sigma},
)
register(
    "qsgd",
    (("--levels", {"type": int, "default": 256, "help": "QSGD quantization levels s"}), SEED),
    lambda a, ax: cj.qsgd(a.levels, key=a.compressor_seed, axis_name=ax),
    lambda a: {"levels": a.levels},
)
register("signsgd", (), lambda a, ax: cj.signsgd(axis_name=ax))
register(
    "cast",
    (("--dtype", {"default": "bfloat16", "choices": ["bfloat16", "float16"], "help": "cast payload dtype"}),),
    lambda a, ax: cj.cast(a.dtype, axis_name=ax),
)
