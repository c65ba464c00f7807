"""Every transform that must behave like an optax citizen, with small arguments: one line each.

A transform added to compjax joins the shared battery (tests/test_battery.py) by adding
one ``Case`` here.  ``factory(*args, axis_name=..., **kwargs)`` builds it; ``static`` names
the arguments that fix shapes (``static_args`` of ``optax.inject_hyperparams``); ``traced``
gives, for one traceable hyperparameter, another value to inject while training;
``random`` marks transforms whose result depends on their key; ``one_path`` gives the arguments
that leave a single path in the compiled program (no warm-up or start-up branch), so that the
audited collectives are exactly those of one step; ``local_steps`` marks transforms whose steps
are local to each worker between synchronizations (DiLoCo): a non-finite gradient skips the step
of that worker only, with no vote.  The battery passes ``params`` to every ``update``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optax
import pytest

import compjax as cj


class Case(NamedTuple):
    factory: Any
    args: tuple = ()
    kwargs: dict = {}
    static: tuple = ()
    traced: tuple | None = None  # (name, other value)
    random: bool = False
    one_path: dict = {}
    local_steps: bool = False

    def make(self, axis_name=None, **overrides):
        return self.factory(*self.args, **{**self.kwargs, **overrides}, axis_name=axis_name)


def delayed_topk(delay, *, axis_name=None, skip_nonfinite=True):
    """Delayed averaging whose exchange goes through top-k with error feedback (on the same axis)."""
    inner = cj.topk(0.05, axis_name=axis_name, skip_nonfinite=False)
    return cj.delayed_averaging(delay, axis_name=axis_name, compressor=inner, skip_nonfinite=skip_nonfinite)


def diloco_sgd(*, sync_every, fragments=1, overlap=0, alpha=0.5, e3m0=False, axis_name=None, skip_nonfinite=True):
    """DiLoCo with inner SGD with momentum; Streaming DiLoCo's 4-bit outer gradients with ``e3m0``."""
    comm = cj.e3m0(axis_name=axis_name, skip_nonfinite=False) if e3m0 else None
    return cj.diloco(optax.sgd(0.1, momentum=0.9), sync_every=sync_every, fragments=fragments, overlap=overlap,
                     alpha=alpha, compressor=comm, axis_name=axis_name, skip_nonfinite=skip_nonfinite)


def sparseloco_sgd(*, sync_every, k=4, chunk=8, decay=0.9, axis_name=None, skip_nonfinite=True):
    """SparseLoCo with inner SGD with momentum: 4 of every 8 x 8 tile, 2-bit values, decayed error feedback."""
    return cj.sparseloco(optax.sgd(0.1, momentum=0.9), sync_every=sync_every, k=k, chunk=chunk, decay=decay,
                         axis_name=axis_name, skip_nonfinite=skip_nonfinite)


CASES = {
    "identity": Case(cj.identity),
    "cast_bf16": Case(cj.cast, ("bfloat16",), static=("dtype",)),
    "topk": Case(cj.topk, (0.05,), static=("ratio",)),
    "randomk": Case(cj.randomk, (0.05,), {"key": 3}, static=("ratio",), random=True),
    # cast to float16 and random-k without error feedback: the full tier only (FULL_ONLY below).
    "cast_f16": Case(cj.cast, ("float16",), static=("dtype",)),
    "randomk_unbiased": Case(cj.randomk, (0.05,), {"key": 3, "error_feedback": False}, static=("ratio",),
                             random=True),
    "dgc": Case(cj.dgc, (0.01,), {"momentum": 0.9, "warmup_steps": 2, "clip_norm": 2.0, "key": 3},
                static=("ratio", "warmup_steps", "sample_ratio"), traced=("momentum", 0.5),
                one_path={"warmup_steps": 0}),
    "powersgd": Case(cj.powersgd, (2,), {"min_compression_rate": 0.0, "start_step": 1},
                     static=("rank", "start_step", "min_compression_rate"), one_path={"start_step": 0}),
    "onebit": Case(cj.onebit),
    "twobit": Case(cj.twobit, (), {"threshold": 0.05}, traced=("threshold", 0.1)),
    "terngrad": Case(cj.terngrad, (), {"key": 3}, traced=("clip_sigma", 1.5), random=True),
    "qsgd": Case(cj.qsgd, (16,), {"key": 3}, static=("levels",), random=True),
    "signsgd": Case(cj.signsgd),
    "e3m0": Case(cj.e3m0),
    "delayed_averaging": Case(cj.delayed_averaging, (), {"delay": 2}, static=("delay",), one_path={"delay": 0}),
    "delayed_averaging_topk": Case(delayed_topk, (), {"delay": 1}, static=("delay",), one_path={"delay": 0}),
    # Averaging every 2 steps, 1 step late: one step in two receives a period's average.
    "delayed_averaging_period": Case(cj.delayed_averaging, (), {"delay": 1, "period": 2}, static=("delay", "period"),
                                     one_path={"delay": 0, "period": 1}),
    "diloco": Case(diloco_sgd, (), {"sync_every": 2}, static=("sync_every", "fragments", "overlap", "e3m0"),
                   one_path={"sync_every": 1}, local_steps=True),
    # H = 2, two fragments (offsets 0 and 1), overlap 1: within 3 steps a fragment starts, one merges, one starts.
    # 8 of every 16 x 16 tile (3%), 2-bit statistical values, 8-bit tile-local indices, decay 0.9.
    "chunktopk": Case(cj.chunktopk, (8,), {"chunk": 16, "decay": 0.9}, static=("k", "chunk", "value_bits"),
                      traced=("decay", 0.5)),
    # DeMo's exchange: DCT of 8 x 8 tiles, float32 values, each entry averaged over the workers that sent it
    # (the full tier only: the "demo" case runs the same exchange).
    "chunktopk_dct": Case(cj.chunktopk, (4,), {"chunk": 8, "dct": True, "values": "float32",
                                               "aggregate": "senders"}, static=("k", "chunk", "value_bits")),
    "sparseloco": Case(sparseloco_sgd, (), {"sync_every": 2}, static=("sync_every", "k", "chunk"),
                       one_path={"sync_every": 1}, local_steps=True),
    "demo": Case(cj.demo, (), {"learning_rate": 0.1, "k": 4, "chunk": 8, "weight_decay": 0.01}, static=("k", "chunk"),
                 traced=("learning_rate", 0.05)),
    "streaming_diloco": Case(diloco_sgd, (), {"sync_every": 2, "fragments": 2, "overlap": 1, "e3m0": True},
                             static=("sync_every", "fragments", "overlap", "e3m0"), traced=("alpha", 0.2),
                             one_path={"sync_every": 1, "fragments": 1, "overlap": 0}, local_steps=True),
}

#: Cases the battery runs in the full tier only (``python -m pytest --all``): the code paths of cast_bf16,
#: randomk and demo, which the fast tier runs; their numbers are checked in test_compressors.py and
#: test_randomk.py.
FULL_ONLY = ("cast_f16", "randomk_unbiased", "chunktopk_dct")


def tiered(names, fast=()):
    """``names`` as pytest parameters: those in ``fast`` run in the fast tier, the others are marked ``slow``
    (the full tier, ``--all``).  Each case not in ``FULL_ONLY`` is in the fast list of some battery test
    (tests/test_tiers.py checks)."""
    return [pytest.param(n) if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]
