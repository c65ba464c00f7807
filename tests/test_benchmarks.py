"""The benchmark script runs (small tree) and writes JSON and markdown with every entry; no timing asserts."""

import json

from experiments.benchmarks import compressors as bench


def test_resnet18_shape_count():
    shapes = bench.resnet18_shapes()
    n = sum(int(__import__("math").prod(s)) for s in shapes.values())
    assert n == 11_689_512  # torchvision resnet18 parameter count (BN running stats are not parameters)


def test_benchmark_writes_tables(tmp_path):
    only = ["identity", "topk(0.01)"]  # compiling every entry takes minutes on 2 cores
    bench.main(["--small", "--repeats", "1", "--only", ",".join(only), "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "compressors.json").read_text())
    names = [r["name"] for r in result["rows"]]
    assert names[0].startswith("elementwise floor")
    assert names[1:] == only
    for r in result["rows"][1:]:
        assert r["ms_median"] > 0 and r["payload_bytes"] > 0
    md = (tmp_path / "compressors.md").read_text()
    assert all(name in md for name in names) and "python -m experiments.benchmarks.compressors" in md


def test_selection_section_reports_exact_and_sampled(tmp_path):
    name = "top-k selection (25M entries at ratio 0.001)"
    bench.main(["--small", "--repeats", "1", "--only", name, "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "compressors.json").read_text())
    rows = result["sections"][name]
    assert [r["name"].split(",")[0].split(" (")[0] for r in rows] == [
        "elementwise floor", "exact jax.lax.top_k", "sampled threshold"]
    assert all(r["ms_median"] > 0 for r in rows)
    assert "same indices as exact: True" in rows[2]["note"]  # the sampled threshold settled: exact top-k
