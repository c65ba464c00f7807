"""Reproduce Deep Gradient Compression (Lin et al., ICLR 2018) in shape: baseline vs gradient dropping vs DGC.

    python -m experiments.reproduce.dgc                      # Fashion-MNIST CNN, 8 workers (CPU: ~15 minutes)
    python -m experiments.reproduce.dgc --seeds 1            # a second seed; the table averages the seeds found
    python -m experiments.reproduce.dgc --config.train.epochs=1   # any main-job key, for every run
    python -m experiments.reproduce.dgc --config experiments/configs/dgc_cifar10_resnet20.py   # for GPUs
    python -m experiments.reproduce.dgc --publish --report-only   # the committed table

Three runs of the main job (:mod:`experiments.train`) with the same data, model,
learning-rate schedule and seed:

* **baseline** -- ``identity`` (dense all-reduce), SGD with momentum;
* **gradient dropping** (Aji & Heafield 2017) -- ``topk`` at the final ratio
  with error feedback, momentum applied *after* the exchange, no warm-up;
* **DGC** -- ``dgc`` at the same ratio: momentum correction, momentum factor
  masking, sampled threshold, and the sparsity warm-up (75% ... 99.6% over the
  config's ``sparsity_warmup_epochs``), plain SGD after it.

The settings live in config files (``experiments/configs/dgc_fashion_mnist_cnn.py``,
``dgc_cifar10_resnet20.py``): ``train``, the main-job config shared by the
runs, and ``runs``, a list of (name, compressor options); every run is a
main-job config, trained by :func:`experiments.train.run_config`.

Writes the JSONL records under ``<out>/dgc/<config>/``, a markdown table
``<out>/dgc_<config>.md`` and the accuracy curves ``<out>/dgc_<config>.png``,
where ``<out>`` is ``runs/reproduce`` (git-ignored), or with ``--publish``
``experiments/results/reproduce`` (the committed results).  Bytes are
counted as sent: int32 indices and float32 values, per worker per step, read
from the compressors' ``payload_bytes`` (which the tests check against the
compiled program).  The table gives the compression ratio twice: at the final
sparsity (the last step, after warm-up -- the ratio the paper reports) and over
the whole run (warm-up included).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections

from experiments import config_cli, train
from experiments.reproduce import common

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIGS / "dgc_fashion_mnist_cnn.py"
PROG = "python -m experiments.reproduce.dgc"


def load_config(path: str | Path = DEFAULT_CONFIG, overrides=()) -> ml_collections.ConfigDict:
    """The reproduction's config: the file ``path`` with ``--config.KEY=VALUE`` ``overrides``."""
    return config_cli.load(path, [f"--config={path}", *overrides], prog=PROG)


def tag(path: str | Path) -> str:
    """The name of a config's outputs: ``dgc_fashion_mnist_cnn.py`` -> ``fashion_mnist_cnn``."""
    return Path(str(path).split(":", 1)[0]).stem.removeprefix("dgc_")


def runs(config: ml_collections.ConfigDict) -> dict[str, ml_collections.ConfigDict]:
    """The compared runs: name -> the main-job config of that run (``config.train`` with the run's compressor).

    A run's ``sparsity_warmup_epochs`` becomes DGC's ``sparsity_warmup_steps``
    (epochs x steps per epoch of the training set, ``train_limit`` images if set).
    """
    train_size = config.train.train_limit or {"fashion_mnist": 60_000, "cifar10": 50_000}[config.train.dataset]
    steps_per_epoch = train_size // config.train.batch_size
    out = {}
    for run in config.runs:
        cfg = train.default_config()
        cfg.update_from_flattened_dict(config_cli.flatten(config.train))
        cfg.compressor.update(run["compressor"])
        if "sparsity_warmup_epochs" in run:
            cfg.compressor.sparsity_warmup_steps = round(run["sparsity_warmup_epochs"] * steps_per_epoch)
        out[run["name"]] = cfg
    return out


def slug(name: str) -> str:
    return name.lower().replace(" ", "_")


def read_records(path: Path) -> tuple[list[dict], dict | None]:
    """The epoch records and the summary of one JSONL file."""
    epochs, summary = [], None
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec["kind"] == "epoch":
                epochs.append(rec)
            elif rec["kind"] == "summary":
                summary = rec
    return epochs, summary


def record_path(record_dir: Path, name: str, seed: int) -> Path:
    """The JSONL record of run ``name`` with ``seed`` (seed 0: ``<run>.jsonl``, else ``<run>_seed<k>.jsonl``)."""
    return record_dir / (f"{slug(name)}.jsonl" if seed == 0 else f"{slug(name)}_seed{seed}.jsonl")


Results = dict[str, list[tuple[list[dict], dict]]]  # run name -> [(epoch records, summary)] per seed


def load_results(record_dir: Path, names: list[str]) -> Results:
    """The records of runs ``names`` under ``record_dir``, every seed found (runs without a summary left out)."""
    results: Results = {}
    for name in names:
        for path in sorted(record_dir.glob(f"{slug(name)}*.jsonl")):
            if path.stem != slug(name) and not path.stem.startswith(f"{slug(name)}_seed"):
                continue
            epochs, summary = read_records(path)
            if summary is not None:
                results.setdefault(name, []).append((epochs, summary))
    return results


def table(results: Results) -> str:
    """Markdown table of the runs: mean test accuracy over the seeds found, deltas against the baseline's mean."""
    def mean_acc(runs):
        return sum(s["test_accuracy"] for _, s in runs) / len(runs)

    base = mean_acc(results["baseline"]) if "baseline" in results else None
    lines = [
        ("| run | compressor options | test accuracy (mean) | per seed | Δ vs baseline (points) | "
         "bytes/step/worker at final sparsity | ratio at final sparsity | mean bytes/step/worker (whole run) | "
         "ratio (whole run) | epochs | wall time (s) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        s = runs[0][1]
        c = s["config"]
        opts = ", ".join(f"{k}={v}" for k, v in c["options"].items()) or "—"
        acc = mean_acc(runs)
        per_seed = ", ".join(f"{100 * r['test_accuracy']:.2f}% (seed {r['config']['seed']})" for _, r in runs)
        delta = f"{100 * (acc - base):+.2f}" if base is not None else "—"
        last, mean, dense = s["payload_bytes_per_step"], s["payload_bytes_mean_per_step"], s["dense_bytes_per_step"]
        lines.append(
            f"| {name} | {c['compressor']}: {opts} | {100 * acc:.2f}% | {per_seed} | {delta} | {last:,} | "
            f"{dense / last:.1f}× | {mean:,.0f} | {dense / mean:.1f}× | {epochs_run(s)} | {s['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def epochs_run(summary: dict) -> str:
    """The epochs a run really trained (``--max-steps`` stops early): ``"10"``, or ``"0.05 (12 steps)"``."""
    done = summary.get("epochs_run", summary["config"]["epochs"])
    return f"{done:g}" if done == int(done) else f"{done:.2f} ({summary.get('steps_taken', summary['steps'])} steps)"


def plot(results: Results, path: Path, title: str) -> None:
    """Test accuracy per epoch of every run, the mean over seeds (matplotlib, Agg backend)."""
    with common.figure(path, figsize=(6, 4)) as (_, ax):
        for name, runs in results.items():
            n = min(len(epochs) for epochs, _ in runs)
            acc = [100 * sum(epochs[e]["test_accuracy"] for epochs, _ in runs) / len(runs) for e in range(n)]
            ax.plot([runs[0][0][e]["epoch"] for e in range(n)], acc, marker="o", label=name)
        common.finish_axes(ax, "epoch", "test accuracy (%), mean over seeds", title)


def main(argv=None) -> dict:
    p = common.parser(PROG, __doc__, DEFAULT_CONFIG, "", config_help=(
        "config file (default: experiments/configs/dgc_fashion_mnist_cnn.py; experiments/configs/dgc_cifar10_resnet20.py "
        "for CIFAR-10); --config.KEY=VALUE overrides a key, e.g. --config.train.epochs=1 for every run"),
        report_only="only rebuild the table and plot from the records")
    p.add_argument("--only", default="", help="comma-separated run names to (re)run, e.g. DGC")
    p.add_argument("--seeds", default=None, help="comma-separated seeds to run (default: the config's seeds); "
                   "the table averages every seed it finds")
    head = common.parse(p, argv, DEFAULT_CONFIG)
    config, args, out_dir = head.config, head.args, head.out_dir
    path = next((a.split("=", 1)[1] for a in head.config_args if a.startswith("--config=")), str(DEFAULT_CONFIG))
    name = tag(path)
    record_dir = out_dir / "dgc" / name
    record_dir.mkdir(parents=True, exist_ok=True)
    todo = runs(config)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if unknown := only - set(todo):
        raise SystemExit(f"--only {args.only}: no run named {sorted(unknown)}; runs: {', '.join(todo)}")
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else list(config.seeds)
    if not args.report_only:
        for seed in seeds:
            for run_name, cfg in todo.items():
                if only and run_name not in only:
                    continue
                cfg.seed = seed
                train.run_config(cfg, out=record_path(record_dir, run_name, seed), command=head.command)
    results = load_results(record_dir, list(todo))
    if not results:
        raise SystemExit(f"no records under {record_dir}")
    text = table(results)
    md = out_dir / f"dgc_{name}.md"
    md.write_text(f"<!-- generated by: {PROG} --config experiments/configs/dgc_{name}.py "
                  f"(--report-only rebuilds it from the records) -->\n{text}")
    plot(results, out_dir / f"dgc_{name}.png", f"DGC reproduction ({name})")
    print(text, end="")
    return {run_name: [s for _, s in runs_] for run_name, runs_ in results.items()}


if __name__ == "__main__":
    main()
