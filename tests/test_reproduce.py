"""The DGC reproduction script: configs become main-job arguments; a tiny run writes the table and the plot."""

import json

import pytest

from experiments import train
from experiments.reproduce import dgc


def test_configs_become_main_job_configs():
    cfg = dgc.load_config(dgc.CONFIGS / "dgc_cifar10_resnet20.py")
    runs = dgc.runs(cfg)
    assert list(runs) == ["baseline", "gradient dropping", "DGC"]
    for run in runs.values():  # every run is a main-job config that passes the main job's checks
        train.check(run, train.build_parser().parse_args([]))
        assert (run.dataset, run.model, run.epochs, run.batch_size, run.augment) == ("cifar10", "resnet20", 160, 128, True)
    assert runs["DGC"].compressor.sparsity_warmup_steps == 4 * (50_000 // 128) and runs["DGC"].compressor.ratio == 0.001
    assert runs["gradient dropping"].compressor.name == "topk" and runs["baseline"].compressor.name == "identity"
    # --config.train.KEY overrides reach every run.
    small = dgc.runs(dgc.load_config(dgc.DEFAULT_CONFIG, ["--config.train.epochs=1"]))
    assert {r.epochs for r in small.values()} == {1}


@pytest.mark.slow  # a tiny reproduction
def test_tiny_reproduction_writes_table_and_plot(tmp_path):
    tiny = ["--config.train.epochs=1", "--config.train.max_steps=2", "--config.train.train_limit=512",
            "--config.train.batch_size=64"]
    out = dgc.main(["--out-dir", str(tmp_path), *tiny])
    assert set(out) == {"baseline", "gradient dropping", "DGC"}
    md = (tmp_path / "dgc_fashion_mnist_cnn.md").read_text()
    assert md.count("\n| ") == 4 and "ratio at final sparsity" in md  # header + 3 runs
    assert (tmp_path / "dgc_fashion_mnist_cnn.png").stat().st_size > 1000
    rec = [json.loads(x) for x in (tmp_path / "dgc" / "fashion_mnist_cnn" / "dgc.jsonl").read_text().splitlines()]
    assert rec[-1]["config"]["options"]["sparsity_warmup_steps"] == 8  # 1 epoch of 512 // 64 steps
    assert "0.25 (2 steps)" in md  # the epochs the runs really trained
    # Report-only rebuilds the same table from the records without training.
    dgc.main(["--out-dir", str(tmp_path), "--report-only"])
    assert (tmp_path / "dgc_fashion_mnist_cnn.md").read_text().split("\n", 1)[1] == md.split("\n", 1)[1]


def test_dga_time_model_by_hand():
    """The step-time model of the DGA reproduction, against hand-computed values (8 workers, one all-reduce)."""
    import math

    from compjax import netmodel
    from compjax.accounting import Collective
    from experiments.reproduce import dga

    ops = [Collective("all-reduce", (("f32", (250,)),), 1000, "a")]
    net = netmodel.Network(bandwidth=1e5, latency=0.04)  # 100 kB/s, 40 ms
    comm_bytes = 2 * 7 / 8 * 1000 / 1e5  # ring all-reduce: 2 (n-1)/n of the bytes
    comm = 2 * 7 * 0.04 + comm_bytes  # + 2 (n-1) latencies = 0.5775 s
    sync = dga.model_step(ops, 0, net, 0.05)
    assert math.isclose(sync["paper"], 0.05 + comm) and math.isclose(sync["in_step"], 0.05 + comm)
    d5 = dga.model_step(ops, 5, net, 0.05)
    assert math.isclose(d5["paper"], comm / 6)  # the latency spread over D + 1 steps dominates here
    assert math.isclose(d5["in_step"], comm)  # one step of compute cannot hide it
    d20 = dga.model_step(ops, 20, net, 0.05)
    assert math.isclose(d20["paper"], 0.05)  # compute-bound: comm / 21 = 27.5 ms < 50 ms
    # One exchange every K = 4 steps: local SGD (D = 0) waits for it once per period; with D >= 1 the paper's
    # system waits at an arrival for what D + 1 steps of compute did not hide; compjax's in-step overlap pays
    # the exchange in one step of four.
    k0 = dga.model_step(ops, 0, net, 0.05, period=4)
    assert math.isclose(k0["paper"], 0.05 + comm / 4) and math.isclose(k0["in_step"], 0.05 + comm / 4)
    k5 = dga.model_step(ops, 5, net, 0.05, period=4)  # two arrivals in the 6 steps that end at one (t = 4, 8)
    assert math.isclose(k5["paper"], 0.05 + (comm - 6 * 0.05) / 2 / 4)
    assert math.isclose(k5["in_step"], (3 * 0.05 + comm) / 4)
    k2 = dga.model_step(ops, 2, net, 0.05, period=4)  # one arrival per period waits for the unhidden rest
    assert math.isclose(k2["paper"], 0.05 + (comm - 3 * 0.05) / 4)
    slow = netmodel.Network(bandwidth=1e3, latency=0.0)  # bandwidth-bound: 1.75 s of bytes per exchange
    assert math.isclose(dga.model_step(ops, 20, slow, 0.05, period=4)["paper"], 2 * 7 / 8 * 1000 / 1e3 / 4)


@pytest.mark.slow  # a tiny reproduction
def test_tiny_dga_reproduction_writes_table_and_plot(tmp_path):
    from experiments.reproduce import dga

    tiny = ["--config.train.epochs=1", "--config.train.max_steps=4", "--config.train.train_limit=1024",
            "--config.train.batch_size=64"]
    rows = dga.main(["--out-dir", str(tmp_path), "--delays", "0,2", *tiny])
    assert [r["delay"] for r in rows] == [0, 2]
    # D = 0 keeps the workers equal; with D = 2 worker 0's own model is reported beside the average
    assert rows[0]["accuracy_worker0"] is None and rows[1]["accuracy_worker0"] is not None
    assert rows[0]["bytes"] == 4 * 206_922  # the dense float32 exchange; no non-finite vote (see the config)
    md = (tmp_path / "dga_fashion_mnist_cnn.md").read_text()
    assert md.count("\n| ") == 3 and "paper's system" in md  # header + 2 runs
    assert (tmp_path / "dga_fashion_mnist_cnn.png").stat().st_size > 1000
    assert json.loads((tmp_path / "dga_fashion_mnist_cnn.json").read_text())["network"]["latency"] > 0.01


@pytest.mark.slow  # a tiny reproduction
def test_tiny_dga_reproduction_with_a_period(tmp_path, capsys):
    """--config.train.compressor.period=2: its own records, table and plot; one exchange every 2 steps."""
    from experiments.reproduce import dga

    tiny = ["--config.train.epochs=1", "--config.train.max_steps=4", "--config.train.train_limit=1024",
            "--config.train.batch_size=64", "--config.train.compressor.period=2"]
    rows = dga.main(["--out-dir", str(tmp_path), "--delays", "0,2", *tiny])
    assert [r["delay"] for r in rows] == [0, 2]
    assert rows[0]["bytes"] == 4 * 206_922 // 2  # local SGD: the dense exchange at steps 1 and 3 of 0-3
    assert rows[1]["bytes"] == 4 * 206_922 // 4  # D = 2: the first period's average arrives at step 3 only
    assert (tmp_path / "dga_k2" / "delay2.jsonl").exists() and not (tmp_path / "dga").exists()
    md = (tmp_path / "dga_fashion_mnist_cnn_k2.md").read_text()
    assert "period=2" in md.splitlines()[0] and "every K = 2 steps: D = 0 is local SGD" in md
    assert md.count("\n| ") == 3 and (tmp_path / "dga_fashion_mnist_cnn_k2.png").stat().st_size > 1000
    assert json.loads((tmp_path / "dga_fashion_mnist_cnn_k2.json").read_text())["period"] == 2
    assert "D=2 (averaging every 2 steps)" in capsys.readouterr().out
