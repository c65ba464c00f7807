"""What every reproduction script shares: the head of its command line and the set-up of its plots.

* :func:`parser` and :func:`parse`: ``--config FILE`` / ``--config.KEY=VALUE``
  (:mod:`experiments.config_cli`), ``--report-only`` where the script can
  rebuild its table from records and ``--out-dir`` / ``--publish``
  (:func:`experiments.records.add_output_arguments`); then the config, the
  flags, the output folder and the command to record.
* :func:`figure`: a matplotlib figure on the Agg backend (no display needed),
  laid out, saved and closed; :func:`finish_axes` labels an axes the way the
  reproductions' accuracy plots do.

Nothing here imports JAX: scripts that must set ``XLA_FLAGS`` first can import it.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import ml_collections

from experiments import config_cli, records

__all__ = ["Head", "figure", "finish_axes", "parse", "parser"]

#: The folder under the results root that reproductions write to.
SUB = "reproduce"


class Head(NamedTuple):
    """A reproduction's parsed command line (:func:`parse`).

    Attributes:
      config: the config file with the ``--config.KEY=VALUE`` overrides applied.
      args: the script's other flags.
      config_args: the ``--config`` and ``--config.*`` arguments as given (``--flag=value``).
      out_dir: where to write (:func:`experiments.records.output_dir`).
      command: the command line to record with the results (``prog`` and ``argv``, shell-quoted).
    """

    config: ml_collections.ConfigDict
    args: argparse.Namespace
    config_args: list[str]
    out_dir: Path
    command: str


def parser(prog: str, doc: str | None, default_config: str | Path, example: str, *, report_only: str | None = None,
           config_help: str | None = None) -> argparse.ArgumentParser:
    """A reproduction's parser with the flags they share; the script adds its own, then calls :func:`parse`.

    Flags, in this order: ``--config`` (:func:`experiments.config_cli.script_parser`),
    ``--report-only`` (with ``report_only``), ``--out-dir`` and ``--publish``.

    Args:
      prog: the command, e.g. ``"python -m experiments.reproduce.dga"``.
      doc: the help text (the script's module docstring).
      default_config: the config file used without ``--config``.
      example: an override shown in ``--config``'s help, e.g. ``"--config.train.epochs=1"``.
      report_only: the help of ``--report-only`` (rebuild the outputs from the records); None: no such flag.
      config_help: the whole ``--config`` help instead of the generated one.

    Returns:
      An :class:`experiments.config_cli.OneLineParser`.
    """
    p = config_cli.script_parser(prog, doc, default_config, example, config_help=config_help)
    if report_only is not None:
        p.add_argument("--report-only", action="store_true", help=report_only)
    records.add_output_arguments(p, SUB)
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None, default_config: str | Path) -> Head:
    """Parse ``argv`` (None: ``sys.argv[1:]``) with the parser from :func:`parser`.

    Raises:
      SystemExit: one line naming a bad flag, config file or key.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    config, args, config_args = config_cli.parse_script(p, argv, default_config)
    return Head(config, args, config_args, records.output_dir(args, SUB), shlex.join([*p.prog.split(), *argv]))


@contextlib.contextmanager
def figure(path: str | Path, *, figsize: tuple[float, float], dpi: int = 120, rect: Sequence[float] | None = None,
           **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """``with figure(path, figsize=(6, 4)) as (fig, ax):`` draw; on leaving, the figure is laid out, saved, closed.

    Args:
      path: the image file (PNG by its suffix).
      figsize: inches ``(width, height)``.
      dpi: dots per inch of the saved image.
      rect: ``fig.tight_layout``'s rectangle (room for a figure legend), or None for the whole figure.
      **subplots: passed to ``plt.subplots`` (``nrows``, ``ncols``, ``squeeze``).

    Yields:
      ``(fig, axes)`` as ``plt.subplots`` returns them.  If the block raises, nothing is saved.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(figsize=figsize, **subplots)
    try:
        yield fig, axes
        fig.tight_layout(rect=rect)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def finish_axes(ax: Any, xlabel: str, ylabel: str, title: str, *, log_x: bool = False, title_size: float | None = None,
                legend_size: float | None = None) -> None:
    """Label ``ax`` as the reproductions' plots are: axis labels, title, a light grid and the legend.

    Args:
      ax: a matplotlib axes.
      xlabel, ylabel: the axis labels.
      title: the title.
      log_x: a logarithmic x axis.
      title_size, legend_size: font sizes; None keeps matplotlib's defaults.
    """
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))
    ax.grid(alpha=0.3)
    ax.legend(**({} if legend_size is None else {"fontsize": legend_size}))
