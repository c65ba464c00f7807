"""Command lines built on ``ml_collections`` configs, the way the flax examples take them.

``--config FILE[:ARG]`` names a config file (a Python file with
``get_config(ARG)``), ``--config.KEY=VALUE`` overrides one of its keys (typed
by the key's current value), and every error is one line
(:class:`OneLineParser`).  Scripts add their own short flags with
:func:`shortcut` and map them onto config keys.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import ml_collections

REPO = Path(__file__).resolve().parents[1]


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit status 2), not usage + message."""

    def error(self, message: str):
        raise SystemExit(f"{self.prog}: {message} (--help lists the options)")


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` -> (the ``--config`` and ``--config.*`` arguments as ``--flag=value``, the rest).

    ``--config FILE`` and ``--config.KEY VALUE`` (two words) become
    ``--config=FILE`` and ``--config.KEY=VALUE``; a ``--config.KEY`` followed by
    another flag stays a bare switch (True for a bool key).
    """
    config, rest, args, i = [], [], list(argv), 0
    while i < len(args):
        a = args[i]
        if a == "--config" or (a.startswith("--config.") and "=" not in a):
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is not None and not nxt.startswith("--"):
                config.append(f"{a}={nxt}")
                i += 2
                continue
            if a == "--config":
                raise SystemExit("--config needs a config file, e.g. --config experiments/configs/main_job.py")
            config.append(a)
        elif a.startswith(("--config=", "--config.")):
            config.append(a)
        else:
            rest.append(a)
        i += 1
    return config, rest


def load(default_file: str | Path, argv: Sequence[str] = (), *, prog: str = "") -> ml_collections.ConfigDict:
    """The config of ``--config FILE[:ARG]`` (default ``default_file``) with the ``--config.KEY=VALUE`` overrides.

    Args:
      default_file: the config file used when ``argv`` has no ``--config``.
      argv: only ``--config`` / ``--config.*`` arguments (:func:`split_config_args`).
      prog: the program's name for error messages.

    Returns:
      The ``ConfigDict`` (locked: its keys can be set, not added).

    Raises:
      SystemExit: one line naming the bad argument (a missing file, an unknown
        key, a value of the wrong type).
    """
    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    head = f"{prog}: " if prog else ""
    args = list(argv)
    file_arg = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), str(default_file))
    if not Path(file_arg.split(":", 1)[0]).is_file():
        raise SystemExit(f"{head}--config {file_arg}: no such config file")
    with mock.patch.object(sys, "argv", ["prog", *args]), warnings.catch_warnings():  # config_flags reads sys.argv
        # ml_collections loads the config file with the deprecated importlib load_module (its own warning, per file)
        warnings.filterwarnings("ignore", "the load_module", DeprecationWarning)
        try:
            config_flags.DEFINE_config_file("config", str(default_file), flag_values=fv, lock_config=True)
            fv(["prog", *args])
            config = fv.config
        except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
            bad = next((a for a in args if a.startswith("--config.") and _unknown(a, e)), None)
            if bad is not None:
                raise SystemExit(f"{head}{bad.split('=', 1)[0]}: no such key in the config {file_arg}") from None
            msg = " ".join(str(e).replace("flag --", "--").split())
            raise SystemExit(f"{head}{msg}") from None
    return config


def script_parser(prog: str, doc: str | None, default_file: str | Path, example: str,
                  config_help: str | None = None) -> OneLineParser:
    """The command line of a reproduction script: ``--config FILE`` and ``--config.KEY=VALUE`` beside its own flags.

    Args:
      prog: the command, e.g. ``"python -m experiments.reproduce.dga"``.
      doc: the help text (the script's module docstring).
      default_file: the config file used without ``--config``.
      example: an override shown in ``--help``, e.g. ``"--config.train.epochs=1"``.
      config_help: the whole ``--config`` help instead of the generated one.

    Returns:
      A :class:`OneLineParser` with ``--config``; the script adds its flags and
      calls :func:`parse_script`.
    """
    p = OneLineParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    shown = Path(default_file).resolve()
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
    p.add_argument("--config", metavar="FILE", help=config_help or (
        f"config file (default: {shown}); --config.KEY=VALUE overrides a key, e.g. {example}"))
    return p


def parse_script(parser: argparse.ArgumentParser, argv: Sequence[str], default_file: str | Path,
                 ) -> tuple[ml_collections.ConfigDict, argparse.Namespace, list[str]]:
    """``(config, args, config_args)`` of a script's ``argv``: the config (:func:`load`), the other flags, and the
    ``--config*`` arguments as given (:func:`split_config_args`).

    Raises:
      SystemExit: one line naming a bad flag, config file or key.
    """
    config_args, rest = split_config_args(argv)
    args = parser.parse_args(rest)
    return load(default_file, config_args, prog=parser.prog), args, config_args


def _unknown(arg: str, err: Exception) -> bool:
    key = arg.split("=", 1)[0].removeprefix("--config.").split(".")[-1]
    return isinstance(err, (AttributeError, KeyError)) and repr(key) in str(err)


def flatten(config: ml_collections.ConfigDict) -> dict:
    """``{"a.b": value}`` of a ConfigDict's leaves (for ``ConfigDict.update_from_flattened_dict``)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, ml_collections.ConfigDict):
            out.update({f"{k}.{kk}": vv for kk, vv in flatten(v).items()})
        else:
            out[k] = v
    return out


def get(config: ml_collections.ConfigDict, path: str):
    """``config`` at the dotted ``path`` (``"compressor.ratio"``)."""
    for part in path.split("."):
        config = config[part]
    return config


def set_(config: ml_collections.ConfigDict, path: str, value) -> None:
    """Set the dotted ``path`` of ``config`` to ``value``."""
    *head, last = path.split(".")
    for part in head:
        config = config[part]
    config[last] = value
