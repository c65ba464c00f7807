"""The main job: data-parallel training of a Flax NNX CNN on Fashion-MNIST with a chosen compressor.

    python -m experiments.train [--compressor NAME] [options]
    python -m experiments.train --config experiments/configs/main_job.py --config.compressor.name=topk \
        --config.compressor.ratio=0.01
    python -m experiments.train --dataset cifar10 --model resnet20 --augment ...   (for accelerators)

The run is described by an ``ml_collections`` config (default
``experiments/configs/main_job.py``; ``--config FILE`` for your own): every key
can be overridden with ``--config.KEY=VALUE``, and the short flags below set
the same keys (``--ratio 0.01`` is ``--config.compressor.ratio=0.01``).  The
config is checked before JAX or any data loads: a bad value exits at once with
one line naming the flag and the allowed range.

Runs on every available device (8 simulated CPU workers when there is no
accelerator).  Prints per-epoch test accuracy, payload bytes per step per worker
and the compression ratio against the dense baseline (4 bytes x parameters),
both measured from the compressor state.  Records: one JSONL file per run under
``runs/train/`` (git-ignored; ``--out`` to choose), named from the compressor,
a hash of the config and the start time, one line per epoch and a summary line
written only when the run finishes; the summary holds the full config, the
command, the git commit, the versions of Python, JAX, Flax, optax and compjax,
and the devices.

Non-finite gradients: the whole chain (compressor + SGD) is wrapped in
``cj.apply_if_finite``, so when any worker's gradient holds a NaN or an
infinity all workers skip the step together, momentum and learning-rate
schedule included: a skipped step is a step that never happened.  Each one is
printed and listed (``skipped_steps``, counted from 0) in the epoch lines and
the summary.  ``--no-skip-nonfinite`` turns the wrapper off.
``--poison-step N`` puts a NaN into one worker's batch at step N;
``--skip-batch N`` drops step N's batch instead, the reference run the
poisoned one should match exactly.

Checkpoints and resuming: ``--checkpoint-dir DIR`` saves the whole training
state every ``--checkpoint-every`` steps and at the end of each epoch (orbax,
:class:`compjax.checkpoint.Checkpointer`); a run started with a DIR that holds a
checkpoint resumes from the latest one and ends bit-identical to a run that
never stopped.  ``--stop-after N`` stops after N steps, as a preempted job would.

Across processes and hosts: ``--num-processes P --process-id I
--coordinator-address HOST:PORT`` (or the ``JAX_*`` environment variables, or
JAX's cluster detection with ``--distributed``) runs the job as one of P
processes through ``jax.distributed``; process 0 writes the records.
``python -m experiments.launch`` starts P local processes.  ``--mesh SLOWxFAST``
builds a 2-D mesh: gradients averaged densely over the fast axis (inside a
host), compressed over the slow axis only.

On CPU the loop blocks on every step (``jax.block_until_ready``): with several
steps in flight, XLA:CPU's in-process collectives can deadlock and abort.
"""

from __future__ import annotations

import sys

from experiments.cpu_devices import force_cpu_devices

# 8 CPU workers unless an accelerator is found (the flag only affects the CPU backend).  XLA:CPU's
# concurrency-optimized scheduler stays on here (the tests turn it off: it has crashed their programs
# with several wrapped compressors side by side): off, a synchronous step whose only collective is the
# gradient's all-reduce ran 5x slower (delayed averaging with D = 0: 93 s per epoch instead of 19 s).
force_cpu_devices(8, concurrency_optimized_scheduler=True)

import argparse
import shlex
from pathlib import Path

import ml_collections

from experiments import compressors, config_cli
from experiments.checks import check_step_flags, parse_mesh

PROG = "python -m experiments.train"
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "main_job.py"
#: dataset -> image shape (height, width, channels); model -> the image shape it takes.
DATASET_SHAPES = {"fashion_mnist": (28, 28, 1), "cifar10": (32, 32, 3)}
MODEL_SHAPES = {"cnn": (28, 28, 1), "resnet20": (32, 32, 3)}
#: Short flags: (flag, config key, type (None: a switch that sets True; "off": a switch that sets False), help).
SHORTCUTS = (
    ("--epochs", "epochs", int, "epochs over the training set"),
    ("--batch-size", "batch_size", int, "global batch, split over the workers"),
    ("--lr", "lr", float, "peak SGD learning rate (linear warm-up, then cosine decay to 0)"),
    ("--warmup-steps", "warmup_steps", int, "steps of linear learning-rate warm-up"),
    ("--momentum", "momentum", float, "momentum of the SGD after the compressor (DGC applies it inside)"),
    ("--weight-decay", "weight_decay", float, "L2 weight decay, added to the gradients"),
    ("--lr-before-compressor", "lr_before_compressor", None,
     "scale each worker's gradient by the learning rate before the compressor (Lin et al. 2018, Alg. 1)"),
    ("--dataset", "dataset", str, "fashion_mnist or cifar10"),
    ("--model", "model", str, "cnn (28x28x1 images) or resnet20 (32x32x3)"),
    ("--augment", "augment", None, "random crop (pad 4) and horizontal flip (CIFAR-10)"),
    ("--seed", "seed", int, "seed of the model's initialization and the data order"),
    ("--workers", "workers", int, "data-parallel workers (off: every device)"),
    ("--mesh", "mesh", str, ("SLOWxFAST, e.g. 2x4: averaged densely over FAST (inside a host), compressed "
                             "over SLOW (between hosts)")),
    ("--fsdp", "fsdp", None, ("with --mesh: shard parameters, optimizer and compressor state over FAST "
                              "(parallel.fsdp_specs); the same numbers as without, 1/FAST of the state per device")),
    ("--max-steps", "max_steps", int, "stop after this many steps"),
    ("--train-limit", "train_limit", int, "use only the first N training images"),
    ("--no-skip-nonfinite", "skip_nonfinite", "off",
     ("turn off the non-finite guard that skips the whole step on every worker when any worker's gradient has "
      "a NaN or an infinity")),
    ("--poison-step", "poison_step", int, ("set one input value of a worker's shard of step N's batch to NaN "
                                           "(steps counted from 0, across epochs)")),
    ("--poison-worker", "poison_worker", int, ("the worker whose shard --poison-step poisons, in [0, workers) "
                                               "(off: 0)")),
    ("--skip-batch", "skip_batch", int, ("drop step N's batch (counted from 0): the reference a --poison-step N "
                                         "run should match")),
)
#: config key -> allowed values, checked before anything loads (compressor options: compressors.Option).
RANGES = {
    "epochs": compressors.Range(1, integer=True),
    "batch_size": compressors.Range(1, integer=True),
    "lr": compressors.Range(0, lo_open=True),
    "warmup_steps": compressors.Range(0, integer=True),
    "momentum": compressors.Range(0, 1, hi_open=True),
    "weight_decay": compressors.Range(0),
    "seed": compressors.Range(0, 2**32, hi_open=True, integer=True),
    "workers": compressors.Range(1, integer=True),
    "max_steps": compressors.Range(1, integer=True),
    "train_limit": compressors.Range(1, integer=True),
}


def _default(key: str):
    value = config_cli.get(default_config(), key)
    return "off" if value is None else value


def default_config() -> ml_collections.ConfigDict:
    """The main job's default config (``experiments/configs/main_job.py``)."""
    from experiments.configs import main_job

    return main_job.get_config()


def build_parser() -> argparse.ArgumentParser:
    """The command line: short flags for the config's keys, then the options of the run itself."""
    p = config_cli.OneLineParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="config file (default: experiments/configs/main_job.py); "
                   "then --config.KEY=VALUE overrides any key, e.g. --config.compressor.ratio=0.01")
    g = p.add_argument_group("the experiment (each sets a key of the config)")
    g.add_argument("--compressor", dest="compressor.name", default=argparse.SUPPRESS, metavar="NAME",
                   help=f"one of {', '.join(sorted(compressors.REGISTRY))} (default: identity)")
    for flag, key, kind, text in SHORTCUTS:
        help_ = f"{text} (default: {_default(key)})".replace("%", "%%")
        if kind is None:
            g.add_argument(flag, dest=key, action="store_const", const=True, default=argparse.SUPPRESS, help=help_)
        elif kind == "off":
            g.add_argument(flag, dest=key, action="store_const", const=False, default=argparse.SUPPRESS,
                           help=text)
        else:
            g.add_argument(flag, dest=key, type=kind, default=argparse.SUPPRESS, metavar=key.upper(), help=help_)
    c = p.add_argument_group("compressor options (each sets compressor.KEY; used by the compressors named)")
    for key, opt in compressors.all_options().items():
        users = [n for n, e in compressors.REGISTRY.items() if opt in e.options]
        text = f"{opt.help} [{', '.join(users)}]".replace("%", "%%")
        if opt.type is None:
            c.add_argument(opt.flag, dest=f"compressor.{key}", action="store_const", const=True,
                           default=argparse.SUPPRESS, help=text)
        else:
            c.add_argument(opt.flag, dest=f"compressor.{key}", type=opt.type, default=argparse.SUPPRESS,
                           metavar=key.upper(), help=f"{text} (default: {'off' if opt.default is None else opt.default})")
    r = p.add_argument_group("the run (not part of the config)")
    r.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="JSONL records (default: runs/train/<compressor>-<config hash>-<start time>.jsonl)")
    r.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                   help="directory of the dataset's files (downloaded there if missing)")
    r.add_argument("--no-download", action="store_true", help="never download the dataset")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    k = p.add_argument_group("checkpoints and multi-process runs")
    k.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="save checkpoints in DIR (orbax) and resume from the latest one found there")
    k.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="save every N steps (default: at the end of each epoch only)")
    k.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop after N steps as a preempted job would, saving a checkpoint there")
    k.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="jax.distributed coordinator (process 0) (default: $JAX_COORDINATOR_ADDRESS)")
    k.add_argument("--num-processes", type=int, default=None, help="(default: $JAX_NUM_PROCESSES, else 1)")
    k.add_argument("--process-id", type=int, default=None, help="(default: $JAX_PROCESS_ID)")
    k.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize even without the three flags above (cluster "
                        "auto-detection: SLURM, Cloud TPU, ...)")
    k.add_argument("--heartbeat-timeout", type=int, default=20, metavar="S",
                   help="seconds without a heartbeat before a process counts as lost (default: 20)")
    return p


def parse(argv=None) -> tuple[ml_collections.ConfigDict, argparse.Namespace]:
    """``(config, options of the run)`` from the command line; one-line ``SystemExit`` on a malformed one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_args, rest = config_cli.split_config_args(argv)
    opts = build_parser().parse_args(rest)
    config = config_cli.load(DEFAULT_CONFIG, config_args, prog=PROG)
    for dest, value in vars(opts).items():
        if dest == "compressor.name" or dest in {k for _, k, _, _ in SHORTCUTS} or dest.startswith("compressor."):
            try:
                config_cli.set_(config, dest, value)
            except (TypeError, KeyError) as e:
                raise SystemExit(f"{PROG}: {dest}={value!r}: {e}") from None
    opts = argparse.Namespace(**{k: v for k, v in vars(opts).items() if "." not in k and not _is_shortcut(k)})
    return config, opts


def _is_shortcut(dest: str) -> bool:
    return dest in {k for _, k, _, _ in SHORTCUTS}


def _short(key: str) -> str | None:
    """The short flag of a config key, if it has one."""
    if key == "compressor.name":
        return "--compressor"
    if key.startswith("compressor."):
        return compressors.all_options()[key.split(".", 1)[1]].flag
    return next((f for f, k, _, _ in SHORTCUTS if k == key), None)


def check(config: ml_collections.ConfigDict, opts: argparse.Namespace) -> None:
    """Everything about the run that can be checked without JAX or the data.

    Raises:
      SystemExit: one line naming the flag, its value and the allowed values.
    """
    def fail(key, value, what):
        short = _short(key)
        head = f"{short} {value}" if short else f"--config.{key}={value}"
        raise SystemExit(f"{head}: {what}" + (f" (config key {key})" if short else ""))

    for key, rng in RANGES.items():
        value = config[key]
        if value is not None and (err := rng.error(value)):
            fail(key, value, err)
    if config.dataset not in DATASET_SHAPES:
        fail("dataset", config.dataset, f"must be one of {', '.join(DATASET_SHAPES)}")
    if config.model not in MODEL_SHAPES:
        fail("model", config.model, f"must be one of {', '.join(MODEL_SHAPES)}")
    if MODEL_SHAPES[config.model] != DATASET_SHAPES[config.dataset]:
        fits = [m for m, s in MODEL_SHAPES.items() if s == DATASET_SHAPES[config.dataset]]
        fail("model", config.model, f"takes {'x'.join(map(str, MODEL_SHAPES[config.model]))} images but "
             f"{config.dataset} has {'x'.join(map(str, DATASET_SHAPES[config.dataset]))}: use --model "
             f"{' or '.join(fits)}")
    for opt, err in compressors.check(config.compressor):
        key = "compressor.name" if opt is None else f"compressor.{opt.key}"
        fail(key, config_cli.get(config, key), err)
    if config.train_limit is not None and config.train_limit < config.batch_size:
        fail("train_limit", config.train_limit, f"must be at least the batch size ({config.batch_size}) for one step")
    if config.fsdp and config.mesh is None:
        raise SystemExit("--fsdp shards over the fast axis of a 2-D mesh: give --mesh SLOWxFAST too")
    if config.mesh is not None:
        parse_mesh(config.mesh)
        if config.workers is not None:
            raise SystemExit("--workers and --mesh both set the workers: give one (--mesh SLOWxFAST has SLOW*FAST)")
    if config.workers is not None and config.batch_size % config.workers:
        fail("batch_size", config.batch_size, f"must be divisible by the {config.workers} workers")
    check_step_flags(config, config.workers)  # a mesh's workers are checked once the devices are known
    for flag, value in (("--checkpoint-every", opts.checkpoint_every), ("--stop-after", opts.stop_after)):
        if value is not None and value < 1:
            raise SystemExit(f"{flag} {value}: must be >= 1 (steps)")
    if opts.checkpoint_every is not None and opts.checkpoint_dir is None:
        raise SystemExit("--checkpoint-every needs --checkpoint-dir (where to save)")


def command(argv=None) -> str:
    """The command line that started the run, to record with it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return shlex.join([*PROG.split(), *argv])


def run_config(config: ml_collections.ConfigDict, *, out: Path | None = None, progress: bool = False,
               command: str = "", **run_options) -> dict:
    """Check ``config`` and train it (what reproductions call: a list of configs, no command lines).

    Args:
      config: a main-job config (:func:`default_config` with keys changed).
      out: the JSONL record file (default: a new file under ``runs/train/``).
      progress: show the progress bar.
      command: the command to record (e.g. the reproduction's).
      **run_options: other options of the run (``data_dir``, ``checkpoint_dir``, ...: the dests of
        :func:`build_parser`'s run options).

    Returns:
      The summary record.

    Raises:
      SystemExit: one line, as on the command line.
    """
    opts = build_parser().parse_args([])
    opts = argparse.Namespace(**{k: v for k, v in vars(opts).items() if "." not in k and not _is_shortcut(k)})
    opts.out, opts.no_progress = out, not progress
    for k, v in run_options.items():
        if not hasattr(opts, k):
            raise TypeError(f"run_config got an unknown run option {k!r}")
        setattr(opts, k, v)
    check(config, opts)
    from experiments import trainer

    return trainer.run(config, opts, command=command)


def main(argv=None) -> dict:
    """Parse, check (before JAX loads), then train: :func:`experiments.trainer.run`. Returns the summary record."""
    config, opts = parse(argv)
    check(config, opts)
    from experiments import trainer  # JAX, flax and the data only now

    return trainer.run(config, opts, command=command(argv))


if __name__ == "__main__":
    main()
