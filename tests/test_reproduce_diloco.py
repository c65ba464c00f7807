"""The DiLoCo reproduction on tiny settings: every row runs, and the table reports what was measured."""

from __future__ import annotations

import json

import pytest

from experiments import config_cli, records
from experiments.reproduce import diloco as repro
from tests.helpers import files_under
from tests.tiny_shakespeare import use_excerpt

#: tiny settings, as --config.KEY=VALUE overrides of the default config (H = 4 for every row, 2 fragments)
TINY = ["--config.train.steps=8", "--config.train.eval_every=4", "--config.train.eval_batches=1",
        "--config.train.batch_per_worker=2", "--config.train.seq_len=16", "--config.sync_every=4",
        "--config.streaming.sync_every=0", "--config.streaming.fragments=2"]
ROWS = ["data-parallel", "streaming", "streaming-fsdp"]


def _outputs(rows):
    return sorted([*(f"reproduce/diloco/{r}.json" for r in rows),
                   *(f"reproduce/{repro.NAME}.{ext}" for ext in ("json", "md", "png"))])


@pytest.fixture(scope="module")
def tiny_run(roots):
    """Data-parallel and Streaming DiLoCo (also sharded), 8 steps, with the default output: (rows by name, records by name).

    The text is the committed excerpt of Tiny Shakespeare (tests/data), found through $COMPJAX_TINYSHAKESPEARE."""
    with pytest.MonkeyPatch.context() as mp:
        use_excerpt(mp)
        rows = {r["row"]: r for r in repro.main(["--rows", *ROWS, *TINY])}
    out = roots[0] / "reproduce" / "diloco"
    return rows, {k: json.loads((out / f"{k}.json").read_text()) for k in rows}


@pytest.mark.slow  # a tiny reproduction
def test_rows_bytes_and_table_under_runs(tiny_run, roots):
    runs, results = roots
    rows, recs = tiny_run
    assert files_under(runs) == _outputs(ROWS) and files_under(results) == []  # the committed results only with --publish
    assert set(rows) == set(ROWS)
    dp, st = rows["data-parallel"], rows["streaming"]
    n = recs["data-parallel"]["config"]["num_params"]
    # Data-parallel: a float32 all-reduce of the model (+ the 4-byte non-finite vote) every step.
    assert recs["data-parallel"]["payload_bytes"] == [4 * n + 4] * 8
    assert dp["total_bytes"] == 8 * (4 * n + 4) and dp["bytes_ratio"] == 1
    # Streaming, H = 4, 2 fragments (offsets 0, 2), overlap 1: fragment 1 starts after steps 2 and 6 and
    # exchanges after 3 and 7, fragment 0 starts after 4 and 8 and exchanges after 5; E3M0 sends about 1/8 of
    # float32 per fragment.
    sent = recs["streaming"]["payload_bytes"]
    assert [i + 1 for i, b in enumerate(sent) if b] == [3, 5, 7]
    assert sum(sent) == st["total_bytes"] and max(sent) == st["peak_bytes"] < (4 * n) / 8
    assert st["bytes_ratio"] == pytest.approx(dp["total_bytes"] / st["total_bytes"])
    assert st["val_loss_mean"] == recs["streaming"]["val_loss_mean"][-1]
    assert st["label"] == "Streaming DiLoCo, H = 4, 2 fragments, τ = 1, E3M0"  # the labels follow the config
    # Sharded over 2 devices per worker (4 x 2 mesh, each device half the worker's batch): the same run.
    sh = recs["streaming-fsdp"]
    assert sh["config"]["mesh"] == "4x2" and sh["config"]["fsdp"] and sh["config"]["batch_per_worker"] == 1
    # The same syncs; a few bytes more where a payload does not split evenly into the 2 devices' pieces.
    assert [bool(b) for b in sh["payload_bytes"]] == [bool(b) for b in sent]
    assert all(0 <= a - b <= 16 for a, b in zip(sh["payload_bytes"], sent)), (sh["payload_bytes"], sent)
    for key in ("val_loss_global", "val_loss_mean", "val_loss_worker0", "train_loss"):
        assert sh[key] == pytest.approx(recs["streaming"][key], abs=2e-4), key
    out = runs / "reproduce"
    md = (out / f"{repro.NAME}.md").read_text()
    assert f"{st['total_bytes']:,}" in md and f"{st['val_loss_mean']:.4f}" in md and ", 8 steps, AdamW" in md
    assert (out / f"{repro.NAME}.png").stat().st_size > 0
    summary = json.loads((out / f"{repro.NAME}.json").read_text())
    command = " ".join([repro.PROG, "--rows", *ROWS, *TINY])
    assert summary["command"] == summary["provenance"]["command"] == command
    assert summary["config"]["train"]["steps"] == 8 and summary["config"]["sync_every"] == 4
    assert summary["config"]["streaming"] == {"sync_every": 0, "fragments": 2, "overlap": 1, "alpha": 0.5, "outer_lr": 1.0}
    assert recs["streaming"]["reproduction"] == {"command": command, "config": summary["config"]}


@pytest.mark.slow  # a tiny reproduction
def test_publish_writes_the_committed_folder_and_report_only_reads_it(tiny_run, monkeypatch, tmp_path):
    """--publish: records and table under experiments/results/reproduce only (the runs replayed from the tiny ones);
    --publish --report-only rebuilds the same table from those records without training."""
    runs, results = tmp_path / "runs", tmp_path / "results"
    monkeypatch.setattr(records, "RUNS", runs)
    monkeypatch.setattr(records, "RESULTS", results)
    rows, recs = tiny_run
    replay = {k: {key: v for key, v in r.items() if key != "reproduction"} for k, r in recs.items()}
    monkeypatch.setattr(repro, "run", lambda row, config: json.loads(json.dumps(replay[row])))
    published = repro.main(["--rows", *ROWS, "--publish", *TINY])
    assert files_under(results) == _outputs(ROWS) and files_under(runs) == []
    assert published == list(rows.values())
    md = (results / "reproduce" / f"{repro.NAME}.md").read_text()
    monkeypatch.setattr(repro, "run", lambda row, config: pytest.fail("--report-only trained"))
    assert repro.main(["--report-only", "--publish", *TINY]) == published
    assert (results / "reproduce" / f"{repro.NAME}.md").read_text() == md and files_under(runs) == []


@pytest.mark.parametrize("args, says", [
    (["--config.nope=1"], "--config.nope: no such key"),
    (["--config.train.nope=1"], "--config.train.nope: no such key"),
    (["--config.sync_every=often"], "--config.sync_every=often: invalid literal for int()"),
    (["--rows", "nope"], "--rows: invalid choice: 'nope'"),
    (["--report-only"], "no records under "),  # never an empty table (e.g. into the README)
])
def test_a_bad_argument_exits_with_one_line(args, says, monkeypatch, tmp_path):
    monkeypatch.setattr(records, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(repro, "run", lambda row, config: pytest.fail("trained before checking the arguments"))
    with pytest.raises(SystemExit) as e:
        repro.main(args)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and msg.startswith(repro.PROG)
    assert files_under(tmp_path / "runs") == []


def test_streaming_row_takes_its_own_sync_every(monkeypatch):
    """config.streaming.sync_every (0: the DiLoCo rows' H) is the H the Streaming row is built and labelled with."""
    config = config_cli.load(repro.DEFAULT_CONFIG, ["--config.sync_every=4", "--config.streaming.sync_every=0"])
    assert repro.streaming_h(config) == 4 and "H = 4, 4 fragments" in repro.labels(config)["streaming"]
    config = config_cli.load(repro.DEFAULT_CONFIG, ["--config.sync_every=4", "--config.streaming.sync_every=6"])
    assert repro.streaming_h(config) == 6 and "H = 6, 4 fragments" in repro.labels(config)["streaming"]
    assert "H = 4 (fp32" in repro.labels(config)["diloco"]
    import compjax

    seen = {}
    monkeypatch.setattr(compjax, "diloco", lambda inner, **kw: seen.update(kw))
    repro.make_tx("streaming", config)("data")
    assert seen["sync_every"] == 6 and seen["fragments"] == 4
