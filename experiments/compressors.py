"""Registry of compressors for the main job: name -> (options, builder), with the options' defaults and ranges.

Adding a compressor is one :func:`register` call: the :class:`Option` s it
takes (each a key of the config's ``compressor`` section, a command-line flag,
a default and the allowed values) and a builder ``(c, axis_name, **common) ->
optax transformation``, where ``c`` holds the compressor's options (and the
run's ``momentum``) as attributes and ``common`` the keyword arguments of every
compjax factory (``skip_nonfinite``, see :func:`build`).

This module imports neither JAX nor compjax until a compressor is built, so the
main job checks a configuration (:func:`check`) in a fraction of a second,
before it loads JAX or any data.  The ranges mirror the factories' own checks
(a test compares the two at the boundaries).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple

import ml_collections
from ml_collections import config_dict


class Range(NamedTuple):
    """An interval of allowed values, printed like compjax's checks: ``[1, inf)``, ``(0, 1]``."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False

    def __str__(self) -> str:
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        return f"{'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open or self.hi is None else ']'}"

    def error(self, value: Any) -> str | None:
        """None if ``value`` lies in the range, else what is wrong (``"must be an integer in [1, inf)"``)."""
        kind = "an integer" if self.integer else "a number"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and self.integer:
            ok = float(value) == int(value)
        if ok and self.lo is not None:
            ok = value > self.lo if self.lo_open else value >= self.lo
        if ok and self.hi is not None:
            ok = value < self.hi if self.hi_open else value <= self.hi
        return None if ok else f"must be {kind} in {self}"


class Option(NamedTuple):
    """One option of a compressor: its config key and flag, default, help text and allowed values.

    ``type`` None makes a switch (a bool, default False, ``--flag`` sets it).
    ``valid``: a :class:`Range`, a tuple of choices, or None (anything of the type).
    ``optional``: None is allowed as well (it means "off", e.g. no clipping).
    """

    flag: str
    type: type | None
    default: Any
    help: str
    valid: Range | tuple | None = None
    optional: bool = False

    @property
    def key(self) -> str:
        """The option's key in the config's ``compressor`` section (``--clip-norm`` -> ``clip_norm``)."""
        return self.flag.lstrip("-").replace("-", "_")

    def error(self, value: Any) -> str | None:
        """None if ``value`` is allowed, else what is wrong."""
        if value is None and (self.optional or self.default is None):
            return None
        if isinstance(self.valid, Range):
            return self.valid.error(value)
        if isinstance(self.valid, tuple) and value not in self.valid:
            return f"must be one of {', '.join(map(str, self.valid))}"
        return None


class Entry(NamedTuple):
    options: tuple[Option, ...]
    build: Callable[..., Any]  # (c, axis_name, **common) -> optax.GradientTransformation
    describe: Callable[[Any], dict]  # c -> the options recorded with the run
    momentum_inside: bool = False  # the compressor carries the momentum (DGC): the optimizer after it has none
    nested: str | None = None  # the key naming another compressor whose options this one uses too (DGA's inner)


REGISTRY: dict[str, Entry] = {}


def register(name: str, options: tuple, build: Callable, describe: Callable | None = None, *,
             momentum_inside: bool = False, nested: str | None = None) -> None:
    """Register compressor ``name`` with its :class:`Option` s and ``build(c, axis_name, **common)``.

    ``build`` passes ``common`` (keyword arguments of every compjax factory,
    e.g. ``skip_nonfinite``) on to the compjax factory unchanged.
    ``describe(c)``: the options recorded with a run (default: every option's value).
    ``momentum_inside``: the compressor applies the run's ``momentum`` itself
    (DGC's momentum correction), so the main job chains a plain SGD after it.
    """
    if describe is None:
        def describe(c, keys=tuple(o.key for o in options)):
            return {k: getattr(c, k) for k in keys}

    REGISTRY[name] = Entry(tuple(options), build, describe, momentum_inside, nested)


def all_options() -> dict[str, Option]:
    """Every registered option by key (options shared by several compressors, e.g. ``ratio``, once)."""
    out: dict[str, Option] = {}
    for entry in REGISTRY.values():
        for opt in entry.options:
            out.setdefault(opt.key, opt)
    return out


def default_config() -> ml_collections.ConfigDict:
    """The config's ``compressor`` section: ``name`` (default ``"identity"``) and every option's default.

    Options whose default is None are typed placeholders, so
    ``--config.compressor.clip_norm=1.0`` still parses as a float.
    """
    c = ml_collections.ConfigDict({"name": "identity"})
    for key, opt in all_options().items():
        if opt.type is None:
            c[key] = bool(opt.default)
        elif opt.default is None:
            c[key] = config_dict.placeholder(opt.type)
        else:
            c[key] = opt.default
    return c


def used_options(c: Mapping) -> list[Option]:
    """The options compressor ``c["name"]`` reads: its own, and those of a nested compressor (DGA's inner)."""
    entry = REGISTRY[c["name"]]
    opts = list(entry.options)
    if entry.nested is not None and c[entry.nested] in REGISTRY:
        opts += [o for o in REGISTRY[c[entry.nested]].options if o.key not in {x.key for x in opts}]
    return opts


def check(c: Mapping) -> list[tuple[Option | None, str]]:
    """What is wrong with the ``compressor`` section ``c``: ``[(option or None for the name, message), ...]``."""
    if c["name"] not in REGISTRY:
        return [(None, f"must be one of {', '.join(sorted(REGISTRY))}")]
    return [(o, err) for o in used_options(c) if (err := o.error(c[o.key])) is not None]


def _namespace(c: Mapping, momentum: float) -> SimpleNamespace:
    return SimpleNamespace(**{k: c[k] for k in c}, momentum=momentum)


def build(c: Mapping, axis_name: str | None, *, momentum: float = 0.9, skip_nonfinite: bool = True):
    """The compressor chosen by ``c["name"]`` and a dict of the options it used.

    Args:
      c: the config's ``compressor`` section (:func:`default_config`).
      axis_name: the workers' mesh axis (None: a single worker).
      momentum: the run's momentum (DGC applies it inside the compressor).
      skip_nonfinite: the compressor's own non-finite guard (every compjax
        factory's ``skip_nonfinite``).

    Returns:
      ``(optax transformation, {option: value})``.

    Raises:
      ValueError: an option out of its range (the factory's message).
    """
    entry = REGISTRY[c["name"]]
    ns = _namespace(c, momentum)
    return entry.build(ns, axis_name, skip_nonfinite=skip_nonfinite), entry.describe(ns)


def momentum_inside(name: str) -> bool:
    """Whether compressor ``name`` carries the momentum itself (then the optimizer after it has none)."""
    return REGISTRY[name].momentum_inside


def _cj():
    import compjax

    return compjax


RATIO = Option("--ratio", float, 0.01, "kept fraction of each layer", Range(0, 1, lo_open=True))
SEED = Option("--compressor-seed", int, 0, "seed of the compressor's randomness", Range(integer=True))

register("identity", (), lambda a, ax, **kw: _cj().identity(axis_name=ax, **kw))
register("topk", (RATIO,), lambda a, ax, **kw: _cj().topk(a.ratio, axis_name=ax, **kw))
register(
    "randomk",
    (RATIO, SEED),
    lambda a, ax, **kw: _cj().randomk(a.ratio, key=a.compressor_seed, axis_name=ax, **kw),
    lambda a: {"ratio": a.ratio},
)
register(
    "dgc",
    (
        RATIO,
        Option("--nesterov", None, False, "DGC: Nesterov momentum correction"),
        Option("--clip-norm", float, None, "DGC: local gradient clipping at clip_norm / sqrt(workers) (None: off)",
               Range(0, lo_open=True)),
        Option("--sparsity-warmup-steps", int, 0, "DGC: steps of sparsity warm-up (4 stages, 75% to the ratio)",
               Range(0, integer=True)),
        Option("--sample-ratio", float, 0.01, "DGC: fraction of the entries sampled for the threshold",
               Range(0, 1, lo_open=True)),
        Option("--exact-topk", None, False, "DGC: exact top-k instead of the sampled threshold"),
        Option("--no-momentum-masking", None, False, "DGC: do not zero the momentum where sent"),
        Option("--dense-vectors", None, False, "DGC: send 1-D leaves dense (the authors' code)"),
        SEED,
    ),
    lambda a, ax, **kw: _cj().dgc(
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
        Option("--rank", int, 2, "PowerSGD: rank of the factors P and Q", Range(1, integer=True)),
        Option("--start-step", int, 0, "PowerSGD: dense steps before compressing", Range(0, integer=True)),
        Option("--min-compression-rate", float, 2.0, "PowerSGD: compress a matrix only above this rate",
               Range(0)),
        SEED,
    ),
    lambda a, ax, **kw: _cj().powersgd(a.rank, start_step=a.start_step,
                                       min_compression_rate=a.min_compression_rate, key=a.compressor_seed,
                                       axis_name=ax, **kw),
    lambda a: {"rank": a.rank, "start_step": a.start_step, "min_compression_rate": a.min_compression_rate},
)

# Quantizers.
register("onebit", (), lambda a, ax, **kw: _cj().onebit(axis_name=ax, **kw))
register(
    "twobit",
    (Option("--threshold", float, 0.5, "2-bit: threshold in gradient units (MXNet's default 0.5)",
            Range(0, lo_open=True)),),
    lambda a, ax, **kw: _cj().twobit(a.threshold, axis_name=ax, **kw),
)
register(
    "terngrad",
    (Option("--clip-sigma", float, 2.5, "TernGrad: clipping at c standard deviations", Range(0, lo_open=True)),
     SEED),
    lambda a, ax, **kw: _cj().terngrad(key=a.compressor_seed, clip_sigma=a.clip_sigma, axis_name=ax, **kw),
    lambda a: {"clip_sigma": a.clip_sigma},
)
register(
    "qsgd",
    (Option("--levels", int, 256, "QSGD: quantization levels s", Range(2, 2**30, integer=True)), SEED),
    lambda a, ax, **kw: _cj().qsgd(a.levels, key=a.compressor_seed, axis_name=ax, **kw),
    lambda a: {"levels": a.levels},
)
register("signsgd", (), lambda a, ax, **kw: _cj().signsgd(axis_name=ax, **kw))
register("e3m0", (), lambda a, ax, **kw: _cj().e3m0(axis_name=ax, **kw))  # Streaming DiLoCo's 4-bit floats
register(
    "cast",
    (Option("--dtype", str, "bfloat16", "cast: payload dtype", ("bfloat16", "float16")),),
    lambda a, ax, **kw: _cj().cast(a.dtype, axis_name=ax, **kw),
)
register(
    "chunktopk",  # SparseLoCo's / DeMo's wire: top-k of each tile, quantized values, packed tile-local indices
    (
        RATIO,
        Option("--chunk", int, 64, "chunktopk: target tile side (tiles of at most chunk x chunk entries; "
               "ceil(ratio * chunk^2) kept per full tile)", Range(1, integer=True)),
        Option("--values", str, "statistical", "chunktopk: how kept values travel",
               ("statistical", "sign", "float32", "bfloat16", "float16")),
        Option("--value-bits", int, 2, "chunktopk: bits per value of the statistical quantizer",
               Range(1, 8, integer=True)),
        Option("--decay", float, 1.0, "chunktopk: decay of the error-feedback accumulator", Range(0, 1)),
        Option("--dct", None, False, "chunktopk: select in each tile's DCT-II domain (DeMo)"),
        Option("--aggregate", str, "mean", "chunktopk: average over all workers, or over the senders of an entry",
               ("mean", "senders")),
    ),
    lambda a, ax, **kw: _cj().chunktopk(
        math.ceil(a.ratio * a.chunk**2) if a.chunk >= 1 else 1, chunk=a.chunk, values=a.values,
        value_bits=a.value_bits, decay=a.decay, dct=a.dct, aggregate=a.aggregate, axis_name=ax, **kw),
)

# Delayed Gradient Averaging: the average of step t - D arrives at step t; any compressor above carries it.
INNER = tuple(sorted(n for n in REGISTRY if not REGISTRY[n].momentum_inside))
register(
    "dga",
    (
        Option("--delay", int, 5, "DGA: steps D before a gradient's average arrives", Range(0, integer=True)),
        Option("--period", int, 1, "DGA: steps K per averaged period (one exchange every K steps)",
               Range(1, integer=True)),
        Option("--inner", str, "identity", "DGA: the compressor of the delayed exchange (its own options apply)",
               INNER),
    ),
    lambda a, ax, **kw: _cj().delayed_averaging(
        a.delay, axis_name=ax, period=a.period, compressor=REGISTRY[a.inner].build(a, ax, skip_nonfinite=False), **kw
    ),
    lambda a: {"delay": a.delay, "period": a.period, "inner": a.inner, **REGISTRY[a.inner].describe(a)},
    nested="inner",
)
