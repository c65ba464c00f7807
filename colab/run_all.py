"""Execute every notebook in colab/ and check each one shows a plot and a table (what CI runs).

    SMALL=1 .venv/bin/python colab/run_all.py                  # every colab/*.ipynb, sorted by name
    SMALL=1 .venv/bin/python colab/run_all.py 02 04_quantizers  # only these (number, stem or file name)
    SMALL=0 .venv/bin/python colab/run_all.py --max-seconds 0 --timeout 3600   # full settings (CPU: ~40 min)
    SMALL=1 .venv/bin/python colab/run_all.py --store          # refresh the outputs committed in colab/

Each notebook runs in a fresh ``python3`` kernel of this interpreter (nbclient), with the repository root
as its working directory (so ``import experiments`` works and the install cell has nothing to do) and
``SMALL=1`` in its environment unless ``SMALL`` is already set.  The executed copies are written to
``runs/notebooks/`` (git-ignored), the failing ones included; nothing else is written, unless ``--store``
writes each notebook that passes back to ``colab/`` with its outputs (what GitHub, Colab and the docs show).

A notebook passes when every cell runs without an error within ``--timeout`` seconds (the whole
notebook, not each cell), and its outputs hold at least one plot (an ``image/png`` output) and at least
one table (``text/markdown`` with a ``|---`` row, or ``text/html`` with ``<table``).  One line per
notebook (name, seconds, plots, tables, OK/FAIL), then the total (wall clock); the exit status is non-zero if
any notebook fails or the total exceeds ``--max-seconds`` (default 300; 0 turns the limit off).  ``--jobs``
notebooks run at once (default 2: a notebook's time is mostly XLA compiling on one core), each in its own kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
OUT = ROOT / "runs" / "notebooks"
#: a markdown table's header rule: ``|---``, ``| ---``, ``|:---`` (alignment) ...
TABLE_RULE = re.compile(r"\|\s*:?-{3,}")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colours in tracebacks
clock = time.monotonic  # the wall clock the total is read from


def discover(directory: Path = COLAB) -> list[Path]:
    """Every ``*.ipynb`` in ``directory`` (not its subfolders), sorted by name."""
    return sorted(directory.glob("*.ipynb"))


def _outputs(nb) -> list:
    """Every output of ``nb``'s cells (an nbformat notebook or a dict of the same shape)."""
    return [out for cell in nb["cells"] for out in cell.get("outputs", [])]


def _text(value) -> str:
    """An output's data value as one string (nbformat may store multi-line text as a list of lines)."""
    return "".join(value) if isinstance(value, list) else str(value)


def count_plots(nb) -> int:
    """Outputs of ``nb`` holding an ``image/png``."""
    return sum("image/png" in out.get("data", {}) for out in _outputs(nb))


def is_table(data: dict) -> bool:
    """Whether an output's data bundle holds a table: markdown with a ``|---`` row, or HTML ``<table``."""
    markdown = _text(data.get("text/markdown", ""))
    html = _text(data.get("text/html", ""))
    return bool(TABLE_RULE.search(markdown)) or "<table" in html.lower()


def count_tables(nb) -> int:
    """Outputs of ``nb`` holding a table (:func:`is_table`)."""
    return sum(is_table(out.get("data", {})) for out in _outputs(nb))


def errors(nb) -> list[str]:
    """``"ename: evalue"`` of every error output of ``nb``."""
    return [f"{out.get('ename')}: {out.get('evalue')}" for out in _outputs(nb) if out.get("output_type") == "error"]


def problems(nb) -> list[str]:
    """Why the executed ``nb`` fails the check (empty when it passes): errors, no plot, no table."""
    found = [f"error {e}" for e in errors(nb)]
    if not count_plots(nb):
        found.append("no plot (image/png output)")
    if not count_tables(nb):
        found.append("no table (text/markdown with a |--- row, or text/html with <table)")
    return found


def execute(path: Path, timeout: float, out_dir: Path = OUT) -> tuple[object, float, str | None]:
    """Run notebook ``path`` in a fresh kernel from the repository root; write the executed copy to ``out_dir``.

    Returns ``(executed notebook, seconds, exception text or None)``.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    deadline = start + timeout

    def cell_timeout(cell) -> int:  # what is left of the notebook's time, for the next cell
        return max(1, int(deadline - time.monotonic()))

    client = NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}},
                            timeout_func=cell_timeout, allow_errors=False, record_timing=True)
    failure = None
    try:
        client.execute(cwd=str(ROOT))
    except CellTimeoutError:
        failure = f"timeout: over {timeout:g} s"
    except (CellExecutionError, DeadKernelError, RuntimeError, TimeoutError) as e:
        # a cell's error, a dead kernel or one that did not start: reported, the next notebook runs
        lines = ANSI.sub("", str(e)).strip().splitlines()
        failure = f"{type(e).__name__}: {lines[-1] if lines else ''}"
    seconds = time.monotonic() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / path.name)
    return nb, seconds, failure


def select(names: list[str], found: list[Path]) -> list[Path]:
    """The notebooks of ``found`` named in ``names`` (file name, stem or number); all if ``names`` is empty."""
    if not names:
        return found

    def named(p: Path, name: str) -> bool:
        return p.name == name or p.stem == name or p.stem.startswith(f"{name}_")  # "02" names 02_dgc.ipynb

    missing = [name for name in names if not any(named(p, name) for p in found)]
    if missing:
        raise SystemExit(f"no such notebook in {COLAB}: {', '.join(missing)}")
    return [p for p in found if any(named(p, name) for name in names)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", help="run only these (number, stem or file name); default: all")
    p.add_argument("--timeout", type=float, default=600, help="seconds for one notebook (default 600)")
    p.add_argument("--max-seconds", type=float, default=300,
                   help="fail if all notebooks together take longer, wall clock (default 300; 0: no limit)")
    p.add_argument("--store", action="store_true",
                   help="write each notebook that passes, with its outputs, back to colab/ (what GitHub and the docs "
                        "show; SMALL=1 only)")
    p.add_argument("--jobs", type=int, default=2,
                   help="notebooks run at once, each in its own kernel (default 2: XLA compiles on one core)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    os.environ.setdefault("SMALL", "1")  # the kernels inherit this process's environment
    if args.store and os.environ["SMALL"] != "1":
        p.error("--store keeps the outputs of the short settings only: run it with SMALL=1")
    notebooks = select(args.notebooks, discover())
    if not notebooks:
        print(f"no notebooks in {COLAB}")
        return 1
    print(f"SMALL={os.environ['SMALL']}: {len(notebooks)} notebooks, executed copies in "
          f"{OUT.relative_to(ROOT)}/", flush=True)
    failed, start = 0, clock()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each notebook's kernel is a process of its own
        runs = [pool.submit(execute, path, args.timeout) for path in notebooks]
        for path, run in zip(notebooks, runs):
            nb, seconds, failure = run.result()
            bad = report(path, nb, seconds, failure)
            failed += bad
            if args.store and not bad:
                store(nb, path)
    total = clock() - start
    over = args.max_seconds > 0 and total > args.max_seconds
    print(f"total {total:.1f} s for {len(notebooks)} notebooks, {args.jobs} at a time (limit {args.max_seconds:g} s): "
          f"{failed} failed" + (", over the time limit" if over else ""))
    return 1 if failed or over else 0


#: Marks a notebook committed with outputs: they come from ``run_all.py --store`` with these settings.
STORED = {"executed_with": "SMALL=1", "by": "colab/run_all.py --store"}


def store(nb, path: Path) -> None:
    """Write the executed notebook ``nb`` to ``path`` with its outputs, without the per-cell timings.

    The notebook's metadata gets ``"compjax": STORED``; ``tests/test_notebooks.py`` checks that every
    committed notebook is such a run and passes :func:`problems`.
    """
    import nbformat

    nb = nbformat.from_dict(json.loads(nbformat.writes(nb)))  # a copy
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # wall-clock stamps: a diff on every run
    nb.metadata["compjax"] = dict(STORED)
    nbformat.write(nb, path)
    print(f"{'':<32} stored with its outputs in {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}",
          flush=True)


def report(path: Path, nb, seconds: float, failure: str | None) -> bool:
    """Print one notebook's line (name, seconds, plots, tables, OK or why not); True if it failed."""
    found = problems(nb)
    if failure and (failure.startswith("timeout") or not errors(nb)):
        found.insert(0, failure)  # a dead kernel leaves no error output, a timeout only a KeyboardInterrupt
    print(f"{path.name:<32} {seconds:7.1f} s  plots {count_plots(nb):2d}  tables {count_tables(nb):2d}  "
          f"{'FAIL: ' + '; '.join(found) if found else 'OK'}", flush=True)
    return bool(found)


if __name__ == "__main__":
    sys.exit(main())
