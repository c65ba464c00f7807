"""The main job's command line: configs the flax way, checks before anything loads, records a researcher can trust."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import compressors, records, results_table, train, trainer

REPO = Path(__file__).resolve().parents[1]

BAD_FLAGS = [
    (["--epochs", "-1"], "--epochs -1"),
    (["--epochs", "0"], "--epochs 0"),
    (["--lr", "-1"], "--lr -1.0"),
    (["--compressor", "topk", "--ratio", "2"], "--ratio 2.0"),
    (["--compressor", "powersgd", "--rank", "0"], "--rank 0"),
    (["--model", "resnet20"], "--model resnet20"),
    (["--config.compressor.ratio=3", "--compressor", "randomk"], "--ratio 3.0"),
    (["--config.nope=1"], "--config.nope"),
    (["--epochs", "x"], "--epochs"),
    (["--momentum", "1"], "--momentum 1.0"),
    (["--compressor", "dga", "--inner", "topk", "--ratio", "0"], "--ratio 0.0"),
    (["--compressor", "dga", "--period", "0"], "--period 0"),
]


@pytest.mark.parametrize("argv, named", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_exit_at_once_with_one_line(argv, named):
    """A fresh process, as a user runs it: non-zero exit, one line on stderr naming the flag (at once: the
    checks run before JAX or the data load, see the next test; no wall-clock assertion here)."""
    r = subprocess.run([sys.executable, "-m", "experiments.train", *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=60, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and r.stdout == ""
    assert len(lines) == 1 and named in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_the_checks_load_neither_jax_nor_data():
    """What makes a bad flag fail at once: parsing and checking import no JAX (checked in a fresh interpreter)."""
    code = ("import sys; from experiments import train; c, o = train.parse(['--compressor', 'dgc']); "
            "train.check(c, o); print(sorted(m for m in ('jax', 'flax', 'optax', 'compjax') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.stdout.strip() == "[]", r.stderr


def test_config_overrides_equal_the_short_flags(tmp_path):
    short, _ = train.parse(["--compressor", "topk", "--ratio", "0.05", "--epochs", "2", "--no-skip-nonfinite"])
    long, _ = train.parse(["--config.compressor.name=topk", "--config.compressor.ratio", "0.05",
                           "--config.epochs=2", "--config.skip_nonfinite=False"])
    assert short.to_dict() == long.to_dict()
    assert short.compressor.ratio == 0.05 and short.epochs == 2 and short.skip_nonfinite is False
    default, _ = train.parse([])
    assert default.to_dict() == train.default_config().to_dict() and default.compressor.name == "identity"
    # A config file of one's own, derived from the main job's.
    own = tmp_path / "mine.py"
    own.write_text("from experiments.configs import main_job\n\ndef get_config():\n    c = main_job.get_config()\n"
                   "    c.compressor.name = 'powersgd'\n    c.compressor.rank = 4\n    return c\n")
    cfg, _ = train.parse(["--config", str(own), "--config.compressor.rank=8", "--lr", "0.1"])
    assert (cfg.compressor.name, cfg.compressor.rank, cfg.lr) == ("powersgd", 8, 0.1)


def test_help_shows_the_defaults():
    text = train.build_parser().format_help()
    assert "(default: 5)" in text and "(default: 0.05)" in text and "(default: identity)" in text
    assert "--config.KEY=VALUE" in text and "transform()" not in text


@pytest.mark.parametrize("name", sorted(n for n, e in compressors.REGISTRY.items() if e.options))
def test_the_ranges_checked_early_are_the_factories(name):
    """At each range's edges the early check and the compjax factory agree: both accept or both refuse."""
    for opt in compressors.REGISTRY[name].options:
        rng = opt.valid
        if not isinstance(rng, compressors.Range) or (rng.lo is None and rng.hi is None):
            continue
        eps = 1 if rng.integer else 1e-6
        probes = [v for b in (rng.lo, rng.hi) if b is not None for v in (b - eps, b, b + eps)]
        for value in probes:
            value = int(value) if rng.integer else float(value)
            cfg = train.default_config()
            cfg.compressor.name = name
            cfg.compressor[opt.key] = value
            early = compressors.check(cfg.compressor) == []
            try:
                compressors.build(cfg.compressor, "data")
                late = True
            except ValueError:
                late = False
            assert early == late, (name, opt.key, value, early, late)


TINY = ["--compressor", "topk", "--ratio", "0.05", "--max-steps", "3", "--epochs", "1", "--train-limit", "2048",
        "--no-progress"]


def test_run_files_are_named_from_the_config_and_the_start_time():
    import datetime

    t = datetime.datetime(2026, 1, 2, 3, 4, 5)
    a = records.run_path("train", "topk", {"ratio": 0.01}, t)
    assert a.parent == records.RUNS / "train" and a.name.startswith("topk-") and a.name.endswith("-20260102-030405.jsonl")
    assert a != records.run_path("train", "topk", {"ratio": 0.1}, t)  # other options, other file
    assert a != records.run_path("train", "topk", {"ratio": 0.01}, t + datetime.timedelta(seconds=1))
    assert a == records.run_path("train", "topk", {"ratio": 0.01}, t)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(a)], cwd=REPO, check=False).returncode
    assert ignored == 0  # git ignores runs/


@pytest.mark.slow  # a main-job run
def test_records_go_to_an_ignored_folder_one_file_per_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(records, "RUNS", tmp_path / "runs")
    first = train.main(TINY)
    files = sorted((tmp_path / "runs" / "train").glob("*.jsonl"))
    assert len(files) == 1 and files[0].name.startswith("topk-")
    summary = json.loads(files[0].read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["full_config"]["compressor"]["ratio"] == 0.05
    prov = summary["provenance"]
    assert prov["command"].startswith("python -m experiments.train --compressor topk")
    assert len(prov["git"]["commit"]) == 40 and prov["versions"]["jax"] and prov["versions"]["compjax"]
    assert prov["device"]["count"] == 8 and prov["device"]["backend"] == "cpu"
    # The real length of a --max-steps run, and the SUMMARY line pairs the run's mean bytes with its ratio.
    assert first["epochs_run"] == pytest.approx(3 / 8) and first["steps_taken"] == 3
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("SUMMARY"))
    mean = float(line.split("mean_bytes/step/worker=")[1].split()[0].replace(",", ""))
    ratio = float(line.split(" ratio=")[1].split("x")[0])
    assert mean == first["payload_bytes_mean_per_step"]
    assert math.isclose(first["dense_bytes_per_step"] / mean, ratio, rel_tol=1e-2)
    table = results_table.table(results_table.load_summaries(tmp_path / "runs" / "train"))
    assert "| 0.375 | 3 |" in table  # epochs and steps really trained, not the config's 1 epoch


@pytest.mark.slow  # a main-job run
def test_a_failed_run_writes_no_summary(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(trainer.models, "accuracy", broken)
    out = tmp_path / "r.jsonl"
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train.main([*TINY, "--max-steps", "1", "--out", str(out)])
    assert not out.exists() or all(json.loads(x)["kind"] != "summary" for x in out.read_text().splitlines())


def test_results_table_averages_seeds_and_shows_the_spread(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    base = {"compressor": "topk", "options": {"ratio": 0.01}, "epochs": 5, "workers": 8, "batch_size": 256,
            "train_images": 60000}
    for seed, acc in ((0, 0.88), (1, 0.90)):
        rec = {"kind": "summary", "config": {**base, "seed": seed}, "test_accuracy": acc, "steps": 1170,
               "payload_bytes_mean_per_step": 16.0, "dense_bytes_per_step": 800, "wall_s": 10.0}
        (runs / f"topk_{seed}.jsonl").write_text(json.dumps(rec) + "\n")
    text = results_table.table(results_table.load_summaries(runs))
    row = next(x for x in text.splitlines() if x.startswith("| topk"))
    assert "| 89.00% ± 1.41 | 0, 1 |" in row and "| 50.0× | 5 | 1170 |" in row


SCRIPTS = ("main_job", "dgc", "dga", "diloco", "federated", "bandwidth_table")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_reproduction_takes_its_config_the_same_way(script, capsys):
    """--config.KEY overrides of an unknown key, a missing file and a bad flag: one line naming it; --help names
    the default config file."""
    import importlib

    mod = importlib.import_module(f"experiments.reproduce.{script}")
    for argv, named in ((["--config.nope=1"], "--config.nope: no such key"),
                        (["--config", "nowhere.py"], "--config nowhere.py: no such config file"),
                        (["--no-such-flag"], "unrecognized arguments: --no-such-flag")):
        with pytest.raises(SystemExit) as e:
            mod.main(argv)
        assert named in str(e.value) and str(e.value).startswith(mod.PROG) and "\n" not in str(e.value)
    with pytest.raises(SystemExit):
        mod.main(["--help"])
    assert "experiments/configs/" in capsys.readouterr().out
