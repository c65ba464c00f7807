"""The README's and the docs' code runs as written, and every command they show still exists.

* The README's quickstart blocks run on the 8 simulated workers (the docs' Getting started page shows the
  same two blocks); the recipes of "Adding compjax to an existing training loop" are the example programs'
  ``train`` functions; the sharded-parameters block prints the line its page quotes; every other ``python``
  block of the docs runs after the pytree quickstart, in its namespace.
* Every shell command in a ``bash`` block of README.md or docs/**/*.md that runs Python (``python -m MODULE``
  or ``python SCRIPT.py``) names a module or script that exists, and each of its ``--flags`` is one that the
  target's ``--help`` lists (a ``--config.KEY=VALUE`` flag needs ``--config``).  The commands themselves are
  long trainings and benchmarks, run by their own tests on tiny settings; the README's test command is the one
  CI runs.
"""

import contextlib
import importlib.util
import inspect
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GETTING_STARTED = DOCS / "getting_started.md"
SHARDED = DOCS / "concepts" / "sharded.md"
#: markdown pages whose bash and python blocks are checked (generated notebook copies are not pages of ours)
PAGES = sorted([README, *(p for p in DOCS.rglob("*.md")
                          if "_build" not in p.parts and "notebooks" not in p.parts)])


def section(path: Path, title: str) -> str:
    """The text of the ``## title`` section of a markdown file (up to the next ``## `` heading)."""
    pattern = rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)"
    match = re.search(pattern, path.read_text(), re.DOTALL | re.MULTILINE)
    assert match, f"{path.relative_to(ROOT)} has no '## {title}' section"
    return match.group(1)


def fenced(text: str, lang: str) -> list[str]:
    """The bodies of the ```lang blocks of a markdown text, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


def quickstart_blocks(path: Path = README) -> list[str]:
    """The ```python blocks of the ``## Quickstart`` section, in order."""
    return fenced(section(path, "Quickstart"), "python")


def run_block(block, name, namespace=None) -> str:
    """Exec one block (in a fresh namespace unless one is given); return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, name, "exec"), {} if namespace is None else namespace)  # noqa: S102 - the test
    return out.getvalue()


@pytest.fixture(scope="module")
def quickstart():
    """The pytree quickstart, run once: (its namespace, what it printed)."""
    (block, _) = quickstart_blocks()
    assert len(block.strip().splitlines()) <= 15
    namespace = {}
    printed = run_block(block, "README quickstart", namespace)
    return namespace, printed


def test_quickstart_has_the_pure_and_the_nnx_block():
    blocks = quickstart_blocks()
    assert len(blocks) == 2
    assert "data_parallel_step(" in blocks[0] and "nnx_data_parallel_step(" in blocks[1]


def test_docs_show_the_readme_quickstarts():
    assert quickstart_blocks(GETTING_STARTED) == quickstart_blocks()


def test_quickstart_runs_and_is_short(quickstart):
    _, printed = quickstart
    assert "all-reduce" in printed  # the audit found PowerSGD's collectives


def test_nnx_quickstart_runs_and_loss_falls():
    block = quickstart_blocks()[1]
    assert len(block.strip().splitlines()) <= 15
    printed = run_block(block, "README quickstart (NNX)")
    losses = [float(m) for m in re.findall(r"^\d+ ([-+0-9.eE]+)$", printed, re.MULTILINE)]
    assert len(losses) >= 5, printed
    assert losses[-1] < 0.8 * losses[0], losses
    assert "all-gather" in printed  # the audit found top-k's sparse exchange
    # The printed byte counter (one entry per worker) equals the bytes of the printed collectives.
    last = printed.strip().splitlines()[-1]
    reported = re.match(r"\[([0-9 ]+)\]", last).group(1).split()
    assert len(reported) == 8 and len(set(reported)) == 1
    assert int(reported[0]) == sum(int(b) for b in re.findall(r"bytes=(\d+)", last)) > 0


def test_existing_loop_recipes_are_the_example_programs():
    """The recipes of "Adding compjax to an existing training loop" are the examples' code (tests run it)."""
    from examples import linen_resnet_compjax, nnx_cnn_compjax

    blocks = fenced(section(GETTING_STARTED, "Adding compjax to an existing training loop"), "python")
    assert blocks == [inspect.getsource(m.train) for m in (linen_resnet_compjax, nnx_cnn_compjax)]


@pytest.mark.slow  # two sharded programs
def test_sharded_parameters_block_prints_what_its_page_says():
    """Each block of the sharded-parameters page (pytree, NNX, a user's own step, mixed precision) runs and prints the line the
    page quotes after it."""
    text = SHARDED.read_text()
    blocks, quoted = fenced(text, "python"), re.findall(r"^prints `([^`]*)`", text, re.MULTILINE)
    assert len(blocks) == len(quoted) == 4
    for block, line in zip(blocks, quoted):
        assert run_block(block, "docs sharded parameters").strip() == line


def other_docs_blocks() -> list[tuple[str, str]]:
    """(page, block) for every ```python block of the docs not checked by the tests above."""
    recipes = fenced(section(GETTING_STARTED, "Adding compjax to an existing training loop"), "python")
    checked = {*quickstart_blocks(), *recipes, *fenced(SHARDED.read_text(), "python")}
    return [(str(p.relative_to(ROOT)), b) for p in PAGES if p != README
            for b in fenced(p.read_text(), "python") if b not in checked]


def test_every_other_docs_block_runs_after_the_quickstart(quickstart):
    namespace, _ = quickstart
    blocks = other_docs_blocks()
    assert len(blocks) >= 8, blocks  # the method pages' optimizer chains, the audit, the guard
    for page, block in blocks:
        try:
            run_block(block, page, dict(namespace))
        except Exception as e:  # any failure: name the page
            raise AssertionError(f"a python block of {page} fails: {e!r}\n{block}") from e


# --- shell commands -------------------------------------------------------------------------------------

PYTHON = re.compile(r"(?:^|\s)(?:sudo\s+)?(?:[\w./]*/)?python3?\s+"
                    r"(?:-m\s+(?P<module>[\w.]+)|(?P<script>[\w./-]+\.py))")


def commands() -> list[tuple[str, str, list[str]]]:
    """(page, target, flags) for every Python command in a bash block of the README and the docs.

    ``target`` is ``-m module`` or a script path; ``experiments.launch ... -- ARGS`` gives ARGS to the module
    it launches (``--module``, by default ``experiments.train``).
    """
    found = []
    for page in PAGES:
        for block in fenced(page.read_text(), "bash"):
            for line in block.splitlines():
                line = re.sub(r"\s#.*$", "", line).strip()
                for part in line.split("&&"):
                    m = PYTHON.search(part)
                    if not m:
                        continue
                    args = part[m.end():].split()
                    target = f"-m {m.group('module')}" if m.group("module") else m.group("script")
                    rel = str(page.relative_to(ROOT))
                    if "--" in args:  # launch: its own flags, then the launched module's
                        cut = args.index("--")
                        inner = "experiments.train"
                        if "--module" in args[:cut]:
                            inner = args[args.index("--module") + 1]
                        found.append((rel, f"-m {inner}", [a for a in args[cut + 1:] if a.startswith("--")]))
                        args = args[:cut]
                    found.append((rel, target, [a for a in args if a.startswith("--")]))
    return found


@pytest.mark.slow  # every command's --help, in processes
def test_commands_name_modules_and_flags_that_exist():
    found = commands()
    targets = {t for _, t, _ in found}
    expected = {"-m experiments.train", "-m pytest", "-m experiments.reproduce.dgc", "colab/run_all.py"}
    assert expected <= targets, targets
    helps = {}
    for target in sorted(targets):
        if target.startswith("-m "):
            assert importlib.util.find_spec(target[3:]) is not None, f"no module {target[3:]}"
        else:
            assert (ROOT / target).is_file(), f"no script {target}"
        run = subprocess.run([sys.executable, *target.split(), "--help"], check=False, capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
        assert run.returncode == 0, f"{target} --help: {run.stderr[-2000:]}"
        helps[target] = run.stdout
    missing = []
    for page, target, flags in found:
        for flag in flags:
            name = "--config" if flag.startswith("--config.") else flag.split("=", 1)[0]
            if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", helps[target]):
                missing.append(f"{page}: {target} {flag}")
    assert not missing, "flags that the command's --help does not list:\n" + "\n".join(missing)


def test_readme_test_command_is_the_one_ci_runs():
    (setup,) = [b for b in fenced(section(README, "Set up"), "bash") if "pytest" in b]
    command = next(line for line in setup.splitlines() if "pytest" in line and not line.startswith("#"))
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
