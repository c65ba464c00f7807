"""The README's quickstart runs as written (on the 8 simulated workers)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs_and_is_short(capsys):
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    assert len(block.strip().splitlines()) <= 15
    exec(compile(block, "README quickstart", "exec"), {})  # noqa: S102 - running the documented code is the test
    printed = capsys.readouterr().out
    assert "all-reduce" in printed  # the audit found PowerSGD's collectives
