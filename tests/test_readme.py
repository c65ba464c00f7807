"""The README's quickstart blocks run as written (on the 8 simulated workers)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_blocks():
    """The ```python blocks of the ``## Quickstart`` section, in order."""
    section = re.search(r"^## Quickstart\n(.*?)(?=^## )", README.read_text(), re.DOTALL | re.MULTILINE).group(1)
    return re.findall(r"^```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)


def run_block(block, name, capsys):
    """Exec one block in a fresh namespace; return what it printed."""
    assert len(block.strip().splitlines()) <= 15
    exec(compile(block, name, "exec"), {})  # noqa: S102 - running the documented code is the test
    return capsys.readouterr().out


def test_quickstart_has_the_pure_and_the_nnx_block():
    blocks = quickstart_blocks()
    assert len(blocks) == 2
    assert "data_parallel_step(" in blocks[0] and "nnx_data_parallel_step(" in blocks[1]


def test_quickstart_runs_and_is_short(capsys):
    printed = run_block(quickstart_blocks()[0], "README quickstart", capsys)
    assert "all-reduce" in printed  # the audit found PowerSGD's collectives


def test_nnx_quickstart_runs_and_loss_falls(capsys):
    printed = run_block(quickstart_blocks()[1], "README quickstart (NNX)", capsys)
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
    """The two recipes of "Adding compjax to an existing training loop" are the examples' code, which tests run."""
    import inspect

    from examples import linen_resnet_compjax, nnx_cnn_compjax

    section = re.search(r"^## Adding compjax to an existing training loop\n(.*?)(?=^## )", README.read_text(),
                        re.DOTALL | re.MULTILINE).group(1)
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert blocks == [inspect.getsource(m.train) for m in (linen_resnet_compjax, nnx_cnn_compjax)]


def test_sharded_parameters_block_prints_what_the_readme_says(capsys):
    """The FSDP block of "Resuming and running across hosts" runs and prints the line the README quotes."""
    section = re.search(r"^## Resuming and running across hosts\n(.*?)(?=^## )", README.read_text(),
                        re.DOTALL | re.MULTILINE).group(1)
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    printed = run_block(block, "README sharded parameters", capsys).strip()
    quoted = re.search(r"^prints `([^`]*)`", section, re.MULTILINE).group(1)
    assert printed == quoted
