"""The Colab notebooks and their runner, checked without executing a kernel (CI runs colab/run_all.py).

The checker functions of ``colab/run_all.py`` are tried on small synthetic notebooks; every notebook in
``colab/`` is read as JSON and checked for what it must hold: its own Colab badge, the install cell, the
XLA flags before JAX starts, the SMALL switch, committed outputs from a stored SMALL=1 run and no hard-coded device
count.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
from pathlib import Path

import nbformat
import pytest
from nbformat import v4

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
FLAG = "--xla_force_host_platform_device_count="


def _load_runner():
    spec = importlib.util.spec_from_file_location("colab_run_all", COLAB / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_all = _load_runner()

PNG = {"output_type": "display_data", "metadata": {}, "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}}
MD_TABLE = {"output_type": "display_data", "metadata": {},
            "data": {"text/markdown": "| a | b |\n|---|---:|\n| 1 | 2 |", "text/plain": "<Markdown>"}}
HTML_TABLE = {"output_type": "execute_result", "metadata": {}, "execution_count": 1,
              "data": {"text/html": "<TABLE><tr><td>1</td></tr></TABLE>", "text/plain": "<HTML>"}}
TEXT = {"output_type": "stream", "name": "stdout", "text": "| not | a table |\n"}
PLAIN = {"output_type": "execute_result", "metadata": {}, "execution_count": 2,
         "data": {"text/plain": "| printed |\n|---|\n| not shown as a table |"}}
ERROR = {"output_type": "error", "ename": "ValueError", "evalue": "boom", "traceback": []}


def synthetic(*outputs, cell_type="code"):
    """A notebook of one cell per output (code cells, unless ``cell_type`` says otherwise)."""
    nb = v4.new_notebook()
    for out in outputs:
        if cell_type == "code":
            cell = v4.new_code_cell("x")
            cell.outputs = [nbformat.from_dict(out)]
        else:
            cell = v4.new_markdown_cell(out["data"]["text/markdown"])
        nb.cells.append(cell)
    return nb


# --- the runner's checkers ------------------------------------------------------------------------------

def test_checkers_count_plots_and_tables():
    nb = synthetic(TEXT, PNG, MD_TABLE, HTML_TABLE, PNG)
    assert run_all.count_plots(nb) == 2
    assert run_all.count_tables(nb) == 2  # markdown and HTML
    assert run_all.problems(nb) == []


def test_checkers_accept_list_text_and_aligned_rules():
    # nbformat may keep multi-line text as a list of lines; alignment rules (|:---|, | --- |) are rules too.
    listed = dict(MD_TABLE, data={"text/markdown": ["| a |\n", "|:---|\n", "| 1 |"]})
    spaced = dict(MD_TABLE, data={"text/markdown": "| a |\n| --- |\n| 1 |"})
    assert run_all.count_tables(synthetic(listed)) == 1
    assert run_all._text(listed["data"]["text/markdown"]) == "| a |\n|:---|\n| 1 |"
    assert run_all.count_tables(synthetic(spaced)) == 1


def test_checkers_report_what_is_missing():
    assert run_all.problems(synthetic(TEXT)) == [
        "no plot (image/png output)", "no table (text/markdown with a |--- row, or text/html with <table)"]
    assert run_all.problems(synthetic(PNG)) == ["no table (text/markdown with a |--- row, or text/html with <table)"]
    assert run_all.problems(synthetic(MD_TABLE)) == ["no plot (image/png output)"]
    # a table in a markdown *cell* (not an output) does not count; neither does printed (plain) text
    assert run_all.count_tables(synthetic(MD_TABLE, cell_type="markdown")) == 0
    assert run_all.count_tables(synthetic(TEXT)) == 0
    assert run_all.count_tables(synthetic(PLAIN)) == 0
    assert run_all.problems(synthetic(PNG, MD_TABLE, ERROR)) == ["error ValueError: boom"]


def test_discover_picks_up_new_notebooks_sorted(tmp_path):
    for name in ["07_new.ipynb", "01_a.ipynb", "notes.md"]:
        (tmp_path / name).write_text("{}")
    assert [p.name for p in run_all.discover(tmp_path)] == ["01_a.ipynb", "07_new.ipynb"]
    assert run_all.select(["07"], run_all.discover(tmp_path))[0].name == "07_new.ipynb"
    with pytest.raises(SystemExit, match="no such notebook"):
        run_all.select(["02"], run_all.discover(tmp_path))


def test_main_exit_status(monkeypatch, tmp_path, capsys):
    """main(): OK lines and status 0; non-zero for a notebook without a table, an error, or the time limit."""
    monkeypatch.setenv("SMALL", "1")  # main() sets it when unset: keep this process's environment as it was
    paths = [tmp_path / "01_ok.ipynb", tmp_path / "02_bad.ipynb"]
    executed = {"01_ok": (synthetic(PNG, MD_TABLE), 10.0, None), "02_bad": (synthetic(PNG), 5.0, None)}
    monkeypatch.setattr(run_all, "discover", lambda: paths)
    monkeypatch.setattr(run_all, "execute", lambda path, timeout: executed[path.stem])
    assert run_all.main(["01"]) == 0
    assert re.search(r"01_ok\.ipynb\s+10\.0 s\s+plots\s+1\s+tables\s+1\s+OK", capsys.readouterr().out)
    assert run_all.main([]) == 1
    assert "02_bad.ipynb" in (out := capsys.readouterr().out) and "FAIL: no table" in out
    monkeypatch.setattr(run_all, "clock", itertools.count(0.0, 7.0).__next__)  # each run: 7 s of wall clock
    assert run_all.main(["01", "--max-seconds", "6"]) == 1
    out = capsys.readouterr().out
    assert "total 7.0 s for 1 notebooks" in out and "over the time limit" in out
    for jobs in ("1", "3"):  # one line per notebook, in order, whatever runs at once
        assert run_all.main(["--jobs", jobs]) == 1
        out = capsys.readouterr().out
        assert out.index("01_ok.ipynb") < out.index("02_bad.ipynb") and f"{jobs} at a time" in out
    with pytest.raises(SystemExit):
        run_all.main(["--jobs", "0"])
    executed["02_bad"] = (synthetic(PNG, MD_TABLE), 1.0, "DeadKernelError: Kernel died")  # no error output
    assert run_all.main(["02"]) == 1
    assert "FAIL: DeadKernelError" in capsys.readouterr().out
    executed["02_bad"] = (synthetic(PNG, MD_TABLE, ERROR), 1.0, "timeout: over 600 s")  # interrupted: an error too
    assert run_all.main(["02"]) == 1
    assert "FAIL: timeout: over 600 s; error ValueError: boom" in capsys.readouterr().out


def test_runner_writes_only_under_runs():
    assert run_all.OUT.relative_to(ROOT).parts[0] == "runs"
    assert "/runs/" in (ROOT / ".gitignore").read_text().split()


# --- every notebook in colab/ ---------------------------------------------------------------------------

def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4


def _code(nb) -> list[str]:
    return [c["source"] for c in nb.cells if c.cell_type == "code"]


def _first(cells: list[str], pattern: str) -> int:
    """Index of the first cell matching ``pattern`` (a regex), or len(cells)."""
    return next((i for i, s in enumerate(cells) if re.search(pattern, s, re.MULTILINE)), len(cells))


@pytest.fixture(params=NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def notebook(request):
    path = request.param
    return path, nbformat.read(path, as_version=4)


def test_badge_with_own_filename(notebook):
    path, nb = notebook
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    badge = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
             f"(https://colab.research.google.com/github/compjax/compjax/blob/main/colab/{path.name})")
    assert badge in first.source
    assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", path.name)


def test_install_cell(notebook):
    _, nb = notebook
    cells = _code(nb)
    i = _first(cells, r"^REPO = ")
    assert i < len(cells), "no install cell (REPO = ...)"
    src = cells[i]
    assert 'REPO = "https://github.com/compjax/compjax"' in src
    assert src.count("https://github.com/") == 1  # the one line a fork changes
    for needed in ['find_spec("compjax")', 'find_spec("experiments")', '"git", "clone", "--depth", "1", REPO',
                   '"pip", "install", "-q", "-e", f"{CLONE}[experiments]"', "os.chdir(CLONE)",
                   "sys.path.insert(0, CLONE)"]:
        assert needed in src, needed
    assert src.count("check=True") == 2
    # importing compjax/jax here would start JAX before XLA_FLAGS is set
    assert not re.search(r"^\s*(import|from)\s+(jax|compjax|experiments)\b", src, re.MULTILINE)
    # plain Python, so nbclient runs it too: no magics or shell escapes anywhere
    assert not any(re.search(r"^\s*[%!]", s, re.MULTILINE) for s in cells)


def test_xla_flags_before_jax_and_small_switch(notebook):
    _, nb = notebook
    cells = _code(nb)
    flags = _first(cells, r'os\.environ\["XLA_FLAGS"\]')
    jax_import = _first(cells, r"^\s*(import|from)\s+(jax|compjax|experiments|flax|optax)\b")
    assert flags < jax_import < len(cells), "XLA_FLAGS must be set in a cell before the first JAX import"
    assert f'"{FLAG}8"' in cells[flags]
    assert '"--xla_cpu_enable_concurrency_optimized_scheduler=false"' in cells[flags]
    assert sum('SMALL = os.environ.get("SMALL", "0") == "1"' in s for s in cells) == 1
    assert _first(cells, r'^SMALL = os\.environ\.get\("SMALL", "0"\) == "1"') < jax_import
    assert any("jax.block_until_ready(" in s for s in cells)
    assert any("plt.show()" in s for s in cells)
    assert any(re.search(r"display\((Markdown|HTML)\(", s) for s in cells)


def test_committed_outputs_are_a_stored_small_run_that_passes(notebook):
    """Each notebook is committed with the outputs of ``run_all.py --store`` (SMALL=1): a plot, a table, no error,
    every code cell run once in order, no wall-clock stamps."""
    path, nb = notebook
    assert nb.metadata.kernelspec.name == "python3"
    assert nb.metadata.get("compjax") == run_all.STORED, f"{path.name}: not stored by run_all.py --store"
    assert run_all.problems(nb) == [], path.name
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{path.name}: cells not run in order"
    assert not any("execution" in c.metadata for c in code), path.name
    nbformat.validate(nb)
    assert json.loads(path.read_text())["nbformat"] == 4


def test_store_writes_outputs_and_the_mark_without_timings(tmp_path):
    nb = synthetic(PNG, MD_TABLE)
    for i, cell in enumerate(nb.cells):
        cell.execution_count = i + 1
        cell.metadata["execution"] = {"iopub.status.busy": "2026-11-25T15:00:00Z"}
    run_all.store(nb, tmp_path / "x.ipynb")
    back = nbformat.read(tmp_path / "x.ipynb", as_version=4)
    assert back.metadata["compjax"] == run_all.STORED and run_all.problems(back) == []
    assert [c.metadata for c in back.cells] == [{}, {}] and "execution" in nb.cells[0].metadata  # a copy was changed


#: A hard-coded worker or device count: the mesh must be every device, the batch a multiple of them.
HARD_CODED = [r"device_count\s*=\s*\d", r"make_mesh\(\s*\d", r"make_2d_mesh\(\s*\d", r"jax\.devices\(\)\[:\s*\d",
              r"\b(n|workers|num_workers|n_workers|WORKERS|NUM_WORKERS)\s*=\s*\d+\b", r"\bnum_workers\s*=\s*\d"]


def test_no_hard_coded_device_count(notebook):
    path, nb = notebook
    flag_lines = 0
    for src in _code(nb):
        for line in src.splitlines():
            if FLAG in line and 'os.environ["XLA_FLAGS"]' in src:  # the one place 8 is allowed
                flag_lines += 1
                continue
            for pattern in HARD_CODED:
                assert not re.search(pattern, line), f"{path.name}: hard-coded device count: {line.strip()}"
    assert flag_lines == 1
