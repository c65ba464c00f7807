"""The benchmark scripts run (small inputs) and write JSON, markdown and a plot where asked; no timing asserts."""

import copy
import json
import math
import sys
import types

import pytest

from experiments import records
from experiments.benchmarks import compressors as bench
from experiments.benchmarks import torch_compare
from tests.helpers import files_under

ONLY = ["identity", "topk(0.01)"]


@pytest.fixture(scope="module")
def small_run(roots):
    """One --small run with the default output (under the runs root)."""
    return bench.main(["--small", "--repeats", "1", "--only", ",".join(ONLY)])


def test_resnet18_shape_count():
    shapes = bench.resnet18_shapes()
    n = sum(math.prod(s) for s in shapes.values())
    assert n == 11_689_512  # torchvision resnet18 parameter count (BN running stats are not parameters)


def test_benchmark_writes_tables_under_runs_by_default(small_run, roots):
    runs, results = roots
    out = runs / "benchmarks"
    assert files_under(out) == ["compressors.json", "compressors.md", "compressors.png"]
    assert files_under(results) == []  # the committed results are written only with --publish
    result = json.loads((out / "compressors.json").read_text())
    assert result == json.loads(json.dumps(small_run))
    assert result["tree"]["leaves"] == 11 and result["provenance"]["command"] == result["command"]
    names = [r["name"] for r in result["rows"]]
    assert names[0].startswith("elementwise floor")
    assert names[1:] == ONLY
    for r in result["rows"][1:]:
        assert r["ms_median"] > 0 and r["payload_bytes"] > 0 and r["state_bytes_per_param"] >= 0
    assert abs(result["rows"][2]["state_bytes_per_param"] - 4.0) < 0.01  # top-k keeps a float32 residual
    assert len(result["loadavg"]["before"]) == 3 and result["machine"]["backend"] and result["machine"]["device"]
    md = (out / "compressors.md").read_text()
    assert all(name in md for name in names) and "python -m experiments.benchmarks.compressors" in md
    assert (out / "compressors.png").stat().st_size > 0
    sections = result["sections"]
    assert list(sections) == list(bench.SECTIONS)
    dgc = sections["dgc(0.001) whole update on one 25M leaf"]
    assert [r["name"].split(",")[0] for r in dgc] == ["elementwise floor (g + e)", "dgc(0.001)", "dgc(0.001)"]
    assert "same entries as exact: True" in dgc[2]["note"]  # the sampled threshold settled: exact top-k
    steps = sections["main-job step (CNN, 8 workers): compile and step time"]
    assert [r["name"] for r in steps] == ONLY and steps[0]["compile_x_dense"] == 1.0
    assert all(r["compile_s"] > 0 and r["ms_median"] > 0 and r["workers"] == 8 for r in steps)
    assert {r["model"] for r in steps} == {"softmax regression (small)"}
    growth = sections["cost growth, 1M to 64M parameters on one leaf"]
    assert {r["name"] for r in growth} == {"elementwise floor (g + e)", *ONLY}
    assert all(isinstance(r["slope"], float) for r in growth)
    train = sections["donated training step (compressor + SGD), one worker"]
    assert [r["name"] for r in train] == ["SGD step alone (no compressor)", *ONLY] and train[0]["x_floor"] == 1.0
    assert all(r["ms_median"] > 0 and r["guard_off_ms"] > 0 and "guard off" in r["note"] for r in train[1:])
    draws = sections["one uniform draw per parameter"]
    assert "threefry" in draws[1]["name"] and "hash" in draws[2]["name"]
    for sname in sections:  # every section has its table in the markdown
        assert f"**{sname}**" in md


def test_publish_writes_the_committed_folder(small_run, roots, monkeypatch, tmp_path):
    """--publish writes under experiments/results/benchmarks and nothing under runs/ (the run itself is replayed)."""
    runs, results = tmp_path / "runs", tmp_path / "results"
    monkeypatch.setattr(records, "RUNS", runs)
    monkeypatch.setattr(records, "RESULTS", results)
    canned = {k: v for k, v in small_run.items() if k not in ("loadavg", "wall_s", "provenance")}
    monkeypatch.setattr(bench, "run", lambda args: copy.deepcopy(canned) | {"command": "cmd " + " ".join(args.argv)})
    bench.main(["--publish"])
    assert files_under(results) == ["benchmarks/compressors.json", "benchmarks/compressors.md", "benchmarks/compressors.png"]
    assert files_under(runs) == []
    assert json.loads((results / "benchmarks" / "compressors.json").read_text())["command"] == "cmd --publish"


def test_out_dir_wins(small_run, monkeypatch, tmp_path):
    canned = {k: v for k, v in small_run.items() if k not in ("loadavg", "wall_s", "provenance")}
    monkeypatch.setattr(bench, "run", lambda args: copy.deepcopy(canned))
    monkeypatch.setattr(records, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(records, "RESULTS", tmp_path / "results")
    bench.main(["--publish", "--out-dir", str(tmp_path / "mine")])
    assert files_under(tmp_path) == ["mine/compressors.json", "mine/compressors.md", "mine/compressors.png"]


@pytest.mark.parametrize("module", [bench, torch_compare])
def test_a_bad_flag_exits_with_one_line(module, capsys):
    """The benchmarks take plain flags: a --config.KEY (or any unknown flag) is refused in one line."""
    with pytest.raises(SystemExit) as e:
        module.main(["--config.repeats=3"])
    msg = str(e.value)
    assert "--config.repeats=3" in msg and "\n" not in msg and module.PROG in msg


def _torch_result(args, torch):
    return {"command": "python -m experiments.benchmarks.torch_compare " + " ".join(args.argv),
            "machine": {"jax": "0", "torch": "0", "backend": "cpu", "device": "cpu", "threads": 1, "cpu_count": 1,
                        "platform": "test", "processes": "test"},
            "tree": {"params": 1, "leaves": 1}, "repeats": args.repeats,
            "rows": [{"what": "w", "compjax": "c", "compjax_ms": 1.0, "torch": "t", "torch_ms": 2.0, "ratio": 0.5}],
            "provenance": {"command": "x"}}


@pytest.mark.parametrize("publish", [False, True])
def test_torch_compare_writes_under_runs_unless_published(publish, monkeypatch, tmp_path):
    """Where torch_compare writes (the comparison itself replaced by a canned one: no torch needed)."""
    runs, results = tmp_path / "runs", tmp_path / "results"
    monkeypatch.setattr(records, "RUNS", runs)
    monkeypatch.setattr(records, "RESULTS", results)
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setattr(torch_compare, "run", _torch_result)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:torch_compare:start -->\nold\n<!-- results:torch_compare:end -->\n")
    result = torch_compare.main(["--repeats", "1", *(["--publish", "--readme", str(readme)] if publish else [])])
    written, empty = (results, runs) if publish else (runs, results)
    assert files_under(written) == ["benchmarks/torch_compare.json", "benchmarks/torch_compare.md"]
    assert files_under(empty) == []
    on_disk = json.loads((written / "benchmarks" / "torch_compare.json").read_text())
    assert on_disk == json.loads(json.dumps(result)) and on_disk["rows"][0]["ratio"] == 0.5
    md = (written / "benchmarks" / "torch_compare.md").read_text()
    assert "| w | c | 1.0 | t | 2.0 | 0.50 |" in md
    block = md if publish else "old\n"  # the README changes only when asked
    assert readme.read_text() == f"<!-- results:torch_compare:start -->\n{block}<!-- results:torch_compare:end -->\n"
