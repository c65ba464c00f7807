"""The main job's pieces: IDX loader with checksums, registry, a short end-to-end run, the results table."""

import gzip
import hashlib
import json

import jax
import numpy as np
import pytest

from experiments import compressors, data, results_table, train, trainer


def config_of(name: str):
    """The main job's default config with compressor ``name``."""
    cfg = train.default_config()
    cfg.compressor.name = name
    return cfg


def write_idx(path, arr):
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    raw = header + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw))
    return raw


def test_idx_parse_and_checksum(tmp_path, monkeypatch):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", arr)
    with pytest.raises(data.ChecksumError, match="MD5"):
        data.load_file("t10k-images-idx3-ubyte", tmp_path)
    monkeypatch.setitem(data.FILES, "t10k-images-idx3-ubyte", hashlib.md5(raw).hexdigest())
    np.testing.assert_array_equal(data.load_file("t10k-images-idx3-ubyte", tmp_path), arr)


def test_idx_rejects_bad_header():
    with pytest.raises(ValueError, match="IDX"):
        data.parse_idx(b"\x00\x00\x0d\x01\x00\x00\x00\x01\x00")
    with pytest.raises(ValueError, match="header"):
        data.parse_idx(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))


def test_missing_files_say_how_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        data.load_file("train-labels-idx1-ubyte", tmp_path, download=False)


def test_registry_builds_every_compressor():
    for name in compressors.REGISTRY:
        cfg = config_of(name)
        tx, opts = compressors.build(cfg.compressor, "data", momentum=cfg.momentum)
        assert hasattr(tx, "init") and hasattr(tx, "update") and isinstance(opts, dict)
        # A compressor that carries the momentum is followed by SGD without one.
        sgd_state = trainer.optimizer(cfg, 100).init({"w": np.zeros(3)})
        has_trace = any(type(s).__name__ == "TraceState" for s in jax.tree.leaves(sgd_state, is_leaf=lambda x: hasattr(x, "_fields")))
        assert has_trace == (not compressors.momentum_inside(name))


@pytest.mark.slow
def test_registry_passes_skip_nonfinite_to_every_compressor():
    """build(..., skip_nonfinite=) reaches every factory: a NaN gradient is skipped only with the guard on."""
    params = {"w": np.zeros((8, 8), np.float32), "b": np.zeros(8, np.float32)}
    grads = {"w": np.full((8, 8), np.nan, np.float32), "b": np.ones(8, np.float32)}
    for name in compressors.REGISTRY:
        for skip in (True, False):
            tx, _ = compressors.build(config_of(name).compressor, None, skip_nonfinite=skip)
            _, state = tx.update(grads, tx.init(params), params)
            assert int(state.skipped) == int(skip), (name, skip)


TINY = ["--compressor", "topk", "--ratio", "0.05", "--epochs", "1", "--train-limit", "512",
        "--batch-size", "64", "--no-progress"]


@pytest.mark.slow  # two runs of the main job (about 20 s)
def test_poisoned_step_is_skipped_like_a_dropped_batch(tmp_path, capsys):
    """A NaN in one worker's batch at step 2 ends exactly like a run that drops step 2's batch."""
    poisoned = train.main(TINY + ["--max-steps", "5", "--poison-step", "2", "--poison-worker", "3",
                                  "--out", str(tmp_path / "p.jsonl")])
    printed = capsys.readouterr().out
    dropped = train.main(TINY + ["--max-steps", "5", "--skip-batch", "2", "--out", str(tmp_path / "s.jsonl")])
    line = "step 2: non-finite gradient on a worker (non-finite loss on worker 3); all 8 workers skipped it"
    assert line in printed
    assert poisoned["skipped_steps"] == [2] and dropped["skipped_steps"] == []
    assert (poisoned["steps"], dropped["steps"]) == (5, 4)
    assert poisoned["steps_applied"] == dropped["steps_applied"] == 4
    # Bitwise: the skipped step left parameters, compressor residuals, momentum and the schedule as they were.
    assert poisoned["params_sha256"] == dropped["params_sha256"] and poisoned["params_finite"]
    assert poisoned["test_accuracy"] == dropped["test_accuracy"]
    assert poisoned["train_loss"] == dropped["train_loss"] and np.isfinite(poisoned["train_loss"])
    epoch = json.loads((tmp_path / "p.jsonl").read_text().splitlines()[0])
    assert epoch["kind"] == "epoch" and epoch["skipped_steps"] == [2]


@pytest.mark.slow  # a main-job run
def test_poisoned_step_without_the_guards_ruins_the_run(tmp_path):
    """With --no-skip-nonfinite the same NaN reaches the parameters: the guards are what protect the run."""
    summary = train.main(TINY + ["--max-steps", "3", "--poison-step", "1", "--no-skip-nonfinite",
                                 "--out", str(tmp_path / "n.jsonl")])
    assert summary["skipped_steps"] == [] and summary["config"]["skip_nonfinite"] is False
    assert summary["params_finite"] is False and not np.isfinite(summary["train_loss"])
    assert summary["test_accuracy"] <= 0.15  # NaN logits: chance (10 classes)


def _no_data(*args, **kwargs):
    raise AssertionError("the flags should have been rejected before loading the data")


@pytest.mark.parametrize("argv, flag", [
    (["--poison-step", "-1"], "--poison-step"),
    (["--skip-batch", "-1"], "--skip-batch"),
    (["--max-steps", "5", "--poison-step", "5"], "--poison-step"),
    (["--epochs", "1", "--train-limit", "512", "--batch-size", "64", "--skip-batch", "8"], "--skip-batch"),
    (["--poison-step", "1", "--poison-worker", "8"], "--poison-worker"),
    (["--poison-step", "1", "--poison-worker", "-1"], "--poison-worker"),
    (["--poison-worker", "1"], "--poison-worker"),
    (["--poison-step", "1", "--skip-batch", "1"], "--poison-step"),
])
def test_bad_step_flags_fail_before_loading_data(monkeypatch, argv, flag):
    monkeypatch.setitem(trainer.DATASETS, "fashion_mnist", _no_data)
    with pytest.raises(SystemExit, match=flag):
        train.main(argv + ["--no-progress"])


def test_step_flags_beyond_the_run_fail(tmp_path, monkeypatch):
    """The run's length is known once the data is: 1 epoch of 60000 images in batches of 256 is 234 steps."""
    monkeypatch.setitem(trainer.DATASETS, "fashion_mnist", small_fashion_mnist(60000, 16))
    argv = ["--epochs", "1", "--poison-step", "234", "--out", str(tmp_path / "x.jsonl"), "--no-progress"]
    with pytest.raises(SystemExit, match=r"--poison-step 234: this run has 234 steps.*\[0, 234\)"):
        train.main(argv)


def small_fashion_mnist(n_train=2048, n_test=256):
    """A loader like ``data.load_fashion_mnist`` giving random images of its shapes and dtypes: (N, 28, 28, 1)
    float32 in [0, 1] and int32 labels in [0, 10): the main job's code without reading and decoding the files."""

    def load(*args, **kwargs):
        rng = np.random.default_rng(0)
        images = lambda n: rng.random((n, 28, 28, 1), dtype=np.float32)
        labels = lambda n: rng.integers(0, 10, size=n).astype(np.int32)
        return images(n_train), labels(n_train), images(n_test), labels(n_test)

    return load


def test_main_job_runs_and_writes_records(tmp_path, monkeypatch):
    # The data's own loading and checksums are tested above and by the full tier's main-job runs.
    monkeypatch.setitem(trainer.DATASETS, "fashion_mnist", small_fashion_mnist())
    out = tmp_path / "run.jsonl"
    summary = train.main(["--compressor", "topk", "--ratio", "0.05", "--max-steps", "3", "--epochs", "1",
                          "--train-limit", "2048", "--out", str(out), "--no-progress"])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["epoch", "summary"]
    assert summary["steps"] == 3 and 0.0 <= summary["test_accuracy"] <= 1.0
    # The ratio printed is measured from payload_bytes: topk sends k*(4+4) bytes per layer.
    assert summary["compression_ratio"] == pytest.approx(summary["dense_bytes_per_step"] / lines[0]["payload_bytes_per_step"])
    assert 5 < summary["compression_ratio"] < 20


def test_results_table_regenerates_from_records(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for name, acc, nbytes in [("identity", 0.9, 800), ("topk", 0.89, 16)]:
        rec = {"kind": "summary", "config": {"compressor": name, "options": {}, "epochs": 5, "workers": 8,
                                             "train_images": 60000, "batch_size": 256},
               "steps": 1170, "test_accuracy": acc, "payload_bytes_mean_per_step": nbytes,
               "compression_ratio": 800 / nbytes, "wall_s": 1.0}
        (runs / f"{name}.jsonl").write_text(json.dumps({"kind": "epoch"}) + "\n" + json.dumps(rec) + "\n")
    out = tmp_path / "t.md"
    text = results_table.main(["--runs", str(runs), "--out", str(out)])
    assert "| topk | — | 89.00% | — | -1.00 | 16 | 50.0× | 5 | 1170 |" in text
    command = f"python -m experiments.results_table --runs {runs} --out {out}"
    assert out.read_text() == f"<!-- generated by: {command} -->\n{text}"


def test_lr_before_compressor_is_the_same_sgd_for_a_linear_compressor():
    """Scaling by the learning rate before a linear compressor (identity) changes nothing without momentum."""
    import compjax as cj

    params = {"w": np.ones((3, 2), np.float32)}
    grads = [{"w": np.full((3, 2), float(t + 1), np.float32)} for t in range(4)]
    outs = {}
    for flag in ([], ["--lr-before-compressor"]):
        cfg, _ = train.parse(["--momentum", "0", "--warmup-steps", "2"] + flag)
        tx = trainer.transform(cfg, cj.identity(), 10)
        state, outs[bool(flag)] = tx.init(params), []
        for g in grads:
            u, state = tx.update(g, state, params)
            outs[bool(flag)].append(np.asarray(u["w"]))
    np.testing.assert_allclose(outs[True], outs[False], rtol=1e-6)
    assert np.all(outs[True][1] < 0)  # descent: the updates are -lr * g


@pytest.mark.slow  # a main-job run
def test_main_job_runs_delayed_averaging_with_an_inner_compressor(tmp_path):
    """--compressor dga --delay 2 --inner topk: nothing is sent in the first 2 steps, then top-k's pairs."""
    out = tmp_path / "dga.jsonl"
    summary = train.main(["--compressor", "dga", "--delay", "2", "--inner", "topk", "--ratio", "0.05",
                          "--max-steps", "3", "--epochs", "1", "--train-limit", "2048", "--out", str(out),
                          "--no-progress"])
    assert summary["config"]["options"] == {"delay": 2, "period": 1, "inner": "topk", "ratio": 0.05}
    assert summary["steps"] == 3 and summary["skipped_steps"] == []
    vote = 4  # cj.apply_if_finite's
    topk_bytes = summary["payload_bytes_per_step"] - vote  # the last step sent the first step's gradient
    assert 9 < summary["dense_bytes_per_step"] / topk_bytes < 10.1  # 5% of each layer at 8 B vs 4 B: ~10x
    assert summary["payload_bytes_mean_per_step"] == pytest.approx((2 * vote + topk_bytes + vote) / 3)
    # The workers' parameters differ by their own last local gradients: the workers' average is evaluated,
    # worker 0's model beside it.
    assert summary["evaluated"] == "workers' average"
    assert 0 <= summary["test_accuracy_worker0"] <= 1


def test_evaluated_model_is_the_workers_average_when_they_differ():
    same = {"w": np.tile(np.arange(3.0, dtype=np.float32), (4, 1))}
    model, worker0 = trainer.evaluated_params(same)
    assert worker0 is None
    np.testing.assert_array_equal(model["w"], [0.0, 1.0, 2.0])
    differ = {"w": np.arange(12.0, dtype=np.float32).reshape(4, 3)}
    model, worker0 = trainer.evaluated_params(differ)
    np.testing.assert_array_equal(model["w"], [4.5, 5.5, 6.5])
    np.testing.assert_array_equal(worker0["w"], [0.0, 1.0, 2.0])
    assert model["w"].dtype == np.float32
