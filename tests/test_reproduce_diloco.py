"""The DiLoCo reproduction on tiny settings: every row runs, and the table reports what was measured."""

from __future__ import annotations

import json

import pytest

from experiments.reproduce import diloco as repro


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    settings = dict(repro.SETTINGS, steps=8, eval_every=4, eval_batches=1, batch_per_worker=2, seq_len=16)
    monkeypatch.setattr(repro, "SETTINGS", settings)
    monkeypatch.setattr(repro, "H", 4)
    monkeypatch.setattr(repro, "OUT", tmp_path)
    monkeypatch.setattr(repro, "RUNS", tmp_path / "diloco")
    return settings


def test_rows_bytes_and_table(tiny, tmp_path):
    rows = {r["row"]: r for r in repro.main(["--rows", "data-parallel", "streaming"])}
    assert set(rows) == {"data-parallel", "streaming"}
    dp, st = rows["data-parallel"], rows["streaming"]
    records = {k: json.loads((tmp_path / "diloco" / f"{k}.json").read_text()) for k in rows}
    n = records["data-parallel"]["config"]["num_params"]
    # Data-parallel: a float32 all-reduce of the model (+ the 4-byte non-finite vote) every step.
    assert records["data-parallel"]["payload_bytes"] == [4 * n + 4] * 8
    assert dp["total_bytes"] == 8 * (4 * n + 4) and dp["bytes_ratio"] == 1
    # Streaming, H = 4, 2 fragments (offsets 0, 2), overlap 1: fragment 1 starts after steps 2 and 6 and
    # exchanges after 3 and 7, fragment 0 starts after 4 and 8 and exchanges after 5; E3M0 sends about 1/8 of
    # float32 per fragment.
    sent = records["streaming"]["payload_bytes"]
    assert [i + 1 for i, b in enumerate(sent) if b] == [3, 5, 7]
    assert sum(sent) == st["total_bytes"] and max(sent) == st["peak_bytes"] < (4 * n) / 8
    assert st["bytes_ratio"] == pytest.approx(dp["total_bytes"] / st["total_bytes"])
    assert st["val_loss_mean"] == records["streaming"]["val_loss_mean"][-1]
    md = (tmp_path / f"{repro.NAME}.md").read_text()
    assert f"{st['total_bytes']:,}" in md and f"{st['val_loss_mean']:.4f}" in md
    assert (tmp_path / f"{repro.NAME}.png").stat().st_size > 0
