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


@pytest.mark.slow  # a benchmark run
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
    assert [r["name"].split(",")[0] for r in dgc] == ["elementwise floor (g + e)", "dgc(0.001)", "dgc(0.001)",
                                                      "selection alone", "selection alone"]
    assert "same entries as exact: True" in dgc[2]["note"]  # the sampled threshold settled: exact top-k
    assert dgc[4]["speedup_vs_exact"] > 0 and dgc[2]["page_faults_per_call"] >= 0
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["topk(0.01)"]["guard_off_ms"] > 0 and rows["topk(0.01)"]["ef_off_ms"] > 0
    assert rows["topk(0.01)"]["selection_ms"] > 0 and rows["identity"]["selection_ms"] is None
    assert rows["identity"]["ef_off_ms"] is None  # identity has no error feedback to turn off
    assert "**Targets**" in md and "**where the update's time goes**" in md
    assert {t["target"] for t in result["targets"]} >= {"update <= 4x floor", "growth slope in [0.9, 1.15]"}
    steps = sections["main-job step (CNN, 8 workers): compile and step time"]
    assert [r["name"] for r in steps] == ONLY and steps[0]["compile_x_dense"] == 1.0
    assert all(r["compile_s"] > 0 and r["ms_median"] > 0 and r["workers"] == 8 and r["update_compile_s"] > 0
               for r in steps)
    assert {r["model"] for r in steps} == {"softmax regression (small)"}
    growth = sections["cost growth, 1M to 64M parameters on one leaf"]
    assert {r["name"] for r in growth} == {"elementwise floor (SGD step)", *ONLY, bench.NOT_DONATED}
    assert all(isinstance(r["slope"], float) for r in growth)
    train = sections["donated training step (compressor + SGD), one worker"]
    assert [r["name"] for r in train] == ["SGD step alone (no compressor)", *ONLY] and train[0]["x_floor"] == 1.0
    assert all(r["ms_median"] > 0 and r["guard_off_ms"] > 0 and "guard off" in r["note"] for r in train[1:])
    draws = sections["one uniform draw per parameter"]
    assert "threefry" in draws[1]["name"] and "hash" in draws[2]["name"]
    for sname in sections:  # every section has its table in the markdown
        assert f"**{sname}**" in md


def test_targets_report_each_miss_with_where_the_time_went():
    """Met and missed targets from a run's figures; a miss says why from the same run's measurements."""
    result = {
        "rows": [{"name": "floor", "ms_median": 2.0, "ms_min": 1.0},
                 {"name": "cheap", "ms_median": 7.8, "ms_min": 3.0, "x_floor": 3.9, "guard_off_ms": 7.0,
                  "ef_off_ms": None, "selection_ms": None},
                 {"name": "topk", "ms_median": 10.0, "ms_min": 6.0, "x_floor": 5.0, "guard_off_ms": 9.0,
                  "ef_off_ms": 6.0, "selection_ms": 4.0}],
        "sections": {
            "dgc(0.001) whole update on one 25M leaf": [
                {"ms_median": 10.0}, {"ms_median": 50.0}, {"ms_median": 20.0, "speedup_vs_exact": 2.5, "page_faults_per_call": 29000.0},
                {"ms_median": 36.0}, {"ms_median": 6.0, "speedup_vs_exact": 6.0}],
            "main-job step (CNN, 8 workers): compile and step time": [
                {"name": "identity", "compile_x_dense": 1.0, "compile_s": 1.0, "update_compile_s": 0.1},
                {"name": "topk", "compile_x_dense": 2.5, "compile_s": 2.5, "update_compile_s": 1.2}],
            "cost growth, 1M to 64M parameters on one leaf": [
                {"name": "floor", "size": 2**20, "ms_median": 1.0, "slope": 1.0},
                {"name": "floor", "size": 2**22, "ms_median": 4.0, "slope": 1.0},
                {"name": "topk", "size": 2**20, "ms_median": 5.0, "slope": 1.3},
                {"name": "topk", "size": 2**22, "ms_median": 30.0, "slope": 1.3},
                {"name": "cheap", "size": 2**20, "ms_median": 2.0, "slope": 1.1},
                {"name": "cheap", "size": 2**22, "ms_median": 8.0, "slope": 1.1},
                {"name": bench.NOT_DONATED, "size": 2**20, "ms_median": 1.0, "slope": 2.0},
                {"name": bench.NOT_DONATED, "size": 2**22, "ms_median": 16.0, "slope": 2.0}]},
    }
    torch = {"rows": [{"what": "top-k", "ratio": 0.2, "compjax_ms": 1.0, "torch_ms": 5.0},
                      {"what": "powersgd", "ratio": 1.2, "compjax_ms": 12.0, "torch_ms": 10.0}]}
    got = {(t["target"].split(" ")[0], t["row"]): t for t in bench.targets(result, torch)}
    assert got[("update", "cheap")]["met"] and not got[("update", "topk")]["met"]
    assert got[("update", "topk")]["why"] == (
        "non-finite guard +1.0 ms; error feedback +3.0 ms; compression, exchange and decode 6.0 ms (3.0x floor); "
        "of which the threshold selection alone 4.0 ms (2.0x floor)")
    dgc = got[("dgc", "dgc(0.001), 25M leaf")]
    assert not dgc["met"] and "6.0x faster sampled (36.0 vs 6.0 ms)" in dgc["why"] and "14.0 ms (1.4x floor)" in dgc["why"]
    assert "29,000 minor page faults per call" in dgc["why"]
    assert got[("<=", "top-k")]["met"] and not got[("<=", "powersgd")]["met"]
    assert not got[("step", "topk")]["met"] and "1.20 s of the step's 2.50 s" in got[("step", "topk")]["why"]
    assert ("step", "identity") not in got  # the dense step is the reference
    assert got[("growth", "cheap")]["met"] and not got[("growth", "topk")]["met"]
    assert got[("growth", "topk")]["why"] == "x the SGD step 5.0 at 1M, 7.5 at 4M; the SGD step's own slope 1.00"
    assert ("growth", "floor") not in got and ("growth", bench.NOT_DONATED) not in got


@pytest.mark.slow  # a benchmark run
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


@pytest.mark.slow  # a benchmark run
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


@pytest.mark.slow  # a benchmark run
@pytest.mark.parametrize("publish", [False, True])
def test_torch_compare_writes_under_runs_unless_published(publish, monkeypatch, tmp_path):
    """Where torch_compare writes (the comparison itself replaced by a canned one: no torch needed)."""
    runs, results = tmp_path / "runs", tmp_path / "results"
    monkeypatch.setattr(records, "RUNS", runs)
    monkeypatch.setattr(records, "RESULTS", results)
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setattr(torch_compare, "run", _torch_result)
    result = torch_compare.main(["--repeats", "1", *(["--publish"] if publish else [])])
    written, empty = (results, runs) if publish else (runs, results)
    assert files_under(written) == ["benchmarks/torch_compare.json", "benchmarks/torch_compare.md"]
    assert files_under(empty) == []
    on_disk = json.loads((written / "benchmarks" / "torch_compare.json").read_text())
    assert on_disk == json.loads(json.dumps(result)) and on_disk["rows"][0]["ratio"] == 0.5
    md = (written / "benchmarks" / "torch_compare.md").read_text()
    assert "| w | c | 1.0 | t | 2.0 | 0.50 |" in md


# --- the device check -----------------------------------------------------------------------------------------


def test_skip_names_whole_sections_whose_names_hold_commas():
    """``--skip`` takes the sections' whole names, commas inside them included."""
    every = ",".join(bench.SECTIONS)
    assert any("," in name for name in bench.SECTIONS)
    assert all(bench.skipped(name, every) for name in bench.SECTIONS)
    assert not any(bench.skipped(name, "cost growth,dgc(0.001)") for name in bench.SECTIONS)


@pytest.mark.slow  # the device check's dry run: a tiny memory step, two compressors, 3 steps of the main job (~80 s)
def test_device_check_dry_run_writes_one_report(roots, tmp_path):
    from experiments.benchmarks import device_check, memory

    result = device_check.main(["--dry-run", "--out-dir", str(tmp_path)])
    assert files_under(tmp_path) == ["device_check.json", "device_check.md", "main_job.jsonl"]
    assert json.loads((tmp_path / "device_check.json").read_text()) == json.loads(json.dumps(result, default=str))
    sections = result["sections"]
    assert list(sections) == ["memory", "compressors", "main_job"]
    assert all(s["ok"] and s["wall_s"] > 0 for s in sections.values()), {k: s.get("error") for k, s in
                                                                           sections.items()}
    mem = sections["memory"]
    aot = mem["aot"]
    assert (aot["size"], aot["method"], aot["layout"], aot["mesh"]) == ("tiny", "dense", "replicated", "1x8")
    assert aot["peak"] == aot["argument"] + aot["output"] - aot["alias"] + aot["temp"] > aot["param_bytes"]
    assert aot["param_bytes"] == 4 * aot["params"] and len(mem["loss"]) == 2
    assert all(math.isfinite(x) and 0 < x < 2 * math.log(memory.TINY_VOCAB) for x in mem["loss"])
    assert mem["measured_peak"] is None and "no memory statistics" in mem["note"]  # CPU: no allocator counters
    from compjax import parallel

    again = memory.measure("tiny", "dense", "replicated", parallel.make_2d_mesh(1, 8))  # the benchmark's figure
    assert {k: again[k] for k in ("argument", "output", "alias", "temp", "peak")} == {
        k: aot[k] for k in ("argument", "output", "alias", "temp", "peak")}
    comp = sections["compressors"]
    assert [r["name"] for r in comp["rows"]][1:] == ["identity", "topk(0.01)"] and comp["sections"] == {}
    assert comp["floor_bytes_per_s"] > 0 and comp["nominal_hbm_bytes_per_s"] is None
    assert {t["target"] for t in comp["targets"]} == {"update <= 4x floor"}
    job = sections["main_job"]
    assert job["steps"] == 3 and job["params_finite"] and job["compression_ratio"] > 10
    md = (tmp_path / "device_check.md").read_text()
    assert "dry run" in md and all(f"## {name}" in md for name in sections)
    assert "| tiny dense replicated 1x8 |" in md and "| topk | 3 |" in md


@pytest.mark.slow  # compiles and runs the tiny memory step (~15 s)
def test_device_check_measures_the_allocators_peak_from_before_the_inputs(monkeypatch, tmp_path):
    """With allocator statistics (a GPU or TPU; here stand-ins): the measured peak is the peak less the bytes in
    use before the inputs were made, and its ratio to the AOT peak is reported."""
    from experiments.benchmarks import device_check

    readings = iter([(1_000, 1_000), (5_000, 5_000), (6_000, 9_000_000)])  # before inputs, after, after the steps
    monkeypatch.setattr(device_check, "_device_bytes", lambda: next(readings))
    mem = device_check.main(["--dry-run", "--sections", "memory", "--out-dir", str(tmp_path)])["sections"]["memory"]
    assert mem["ok"] and mem["bytes_in_use_before_inputs"] == 1_000 and mem["peak_bytes_in_use"] == 9_000_000
    assert mem["measured_peak"] == 8_999_000 and mem["note"] == ""
    assert mem["measured_over_aot"] == pytest.approx(8_999_000 / mem["aot"]["peak"])
    assert f"| 8.58 MiB | {mem['measured_over_aot']:.2f} |" in (tmp_path / "device_check.md").read_text()


def test_device_check_refuses_unknown_sections_and_methods():
    from experiments.benchmarks import device_check

    for argv, flag in ((["--sections", "memory,nope"], "--sections"), (["--memory-method", "nope"],
                                                                       "--memory-method")):
        with pytest.raises(SystemExit, match=flag):
            device_check.main(["--dry-run", *argv])
