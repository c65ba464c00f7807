"""Reproduce Deep Gradient Compression (Lin et al., ICLR 2018) in shape: baseline vs gradient dropping vs DGC.

    python -m experiments.reproduce.dgc                      # Fashion-MNIST CNN, 8 workers (CPU: ~10 minutes)
    python -m experiments.reproduce.dgc --seeds 1            # a second seed; the table averages the seeds found
    python -m experiments.reproduce.dgc --report-only --readme README.md   # table + plot from the records
    python -m experiments.reproduce.dgc --config cifar10_resnet20   # ResNet-20 on CIFAR-10 (for GPUs)

Three runs of the main job (:mod:`experiments.train`) with the same data, model,
learning-rate schedule and seed:

* **baseline** -- ``identity`` (dense all-reduce), SGD with momentum;
* **gradient dropping** (Aji & Heafield 2017) -- ``topk`` at the final ratio
  with error feedback, momentum applied *after* the exchange, no warm-up;
* **DGC** -- ``dgc`` at the same ratio: momentum correction, momentum factor
  masking, sampled threshold, and the sparsity warm-up (75% ... 99.6% over the
  config's ``sparsity_warmup_epochs``), plain SGD after it.

The settings live in :mod:`experiments.configs` (``dgc_fashion_mnist_cnn``,
``dgc_cifar10_resnet20``).

Writes the JSONL records under ``experiments/results/reproduce/dgc/<config>/``,
a markdown table ``experiments/results/reproduce/dgc_<config>.md`` and the
accuracy curves ``experiments/results/reproduce/dgc_<config>.png``.  Bytes are
counted as sent: int32 indices and float32 values, per worker per step, read
from the compressors' ``payload_bytes`` (which the tests check against the
compiled program).  The table gives the compression ratio twice: at the final
sparsity (the last step, after warm-up -- the ratio the paper reports) and over
the whole run (warm-up included).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "reproduce"

#: config name -> module with ``get_config()`` (:mod:`experiments.configs`).
CONFIGS = {
    "fashion_mnist_cnn": "experiments.configs.dgc_fashion_mnist_cnn",
    "cifar10_resnet20": "experiments.configs.dgc_cifar10_resnet20",
}
#: the compared runs' names, in the config's order.
NAMES = {"identity": "baseline", "topk": "gradient dropping", "dgc": "DGC"}


def load_config(name: str):
    """The ``ml_collections.ConfigDict`` of config ``name``."""
    return importlib.import_module(CONFIGS[name]).get_config()


def train_args(config) -> list[str]:
    """Main-job arguments shared by every run of ``config``."""
    argv = ["--dataset", config.dataset, "--model", config.model, "--epochs", str(config.epochs),
            "--batch-size", str(config.batch_size), "--lr", str(config.lr), "--momentum", str(config.momentum),
            "--weight-decay", str(config.weight_decay), "--warmup-steps", str(config.warmup_steps)]
    argv += ["--augment"] if config.augment else []
    return argv + (["--lr-before-compressor"] if config.get("lr_before_compressor") else [])


def runs(config) -> dict[str, list[str]]:
    """The compared runs: name -> main-job arguments of the compressor.

    DGC's ``sparsity_warmup_epochs`` becomes ``--sparsity-warmup-steps``
    (epochs x ``train_size // batch_size`` steps).
    """
    steps_per_epoch = config.train_size // config.batch_size
    out = {}
    for run in config.runs:
        run = dict(run)
        comp = run.pop("compressor")
        argv = ["--compressor", comp]
        if "sparsity_warmup_epochs" in run:
            run["sparsity_warmup_steps"] = round(run.pop("sparsity_warmup_epochs") * steps_per_epoch)
        for k, v in run.items():
            flag = f"--{k.replace('_', '-')}"
            argv += ([flag] if v else []) if isinstance(v, bool) else [flag, str(v)]
        out[NAMES.get(comp, comp)] = argv
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
            f"{dense / last:.1f}× | {mean:,.0f} | {dense / mean:.1f}× | {c['epochs']} | {s['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: Results, path: Path, title: str) -> None:
    """Test accuracy per epoch of every run, the mean over seeds (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in results.items():
        n = min(len(epochs) for epochs, _ in runs)
        acc = [100 * sum(epochs[e]["test_accuracy"] for epochs, _ in runs) / len(runs) for e in range(n)]
        ax.plot([runs[0][0][e]["epoch"] for e in range(n)], acc, marker="o", label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%), mean over seeds")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="fashion_mnist_cnn", choices=sorted(CONFIGS))
    p.add_argument("--report-only", action="store_true", help="only rebuild the table and plot from the records")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--only", default="", help="comma-separated run names to (re)run, e.g. DGC")
    p.add_argument("--train-args", default="", help="extra main-job arguments, e.g. '--max-steps 5'")
    p.add_argument("--readme", type=Path, default=None, help="also replace the results:dgc_<config> block of this file")
    p.add_argument("--seeds", default="0", help="comma-separated seeds to run (the table averages all it finds)")
    args = p.parse_args(argv)
    config = load_config(args.config)
    record_dir = args.out_dir / "dgc" / args.config
    record_dir.mkdir(parents=True, exist_ok=True)
    todo = runs(config)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if not args.report_only:
        from experiments import train

        for seed in [int(x) for x in args.seeds.split(",")]:
            for name, comp_args in todo.items():
                if only and name not in only:
                    continue
                out = record_path(record_dir, name, seed)
                train.main(train_args(config) + comp_args + ["--seed", str(seed)] + args.train_args.split()
                           + ["--out", str(out), "--no-progress"])
    results: Results = {}
    for name in todo:
        for path in sorted(record_dir.glob(f"{slug(name)}*.jsonl")):
            if path.stem != slug(name) and not path.stem.startswith(f"{slug(name)}_seed"):
                continue
            epochs, summary = read_records(path)
            if summary is not None:
                results.setdefault(name, []).append((epochs, summary))
    if not results:
        raise SystemExit(f"no records under {record_dir}")
    text = table(results)
    md = args.out_dir / f"dgc_{args.config}.md"
    md.write_text(f"<!-- generated by: python -m experiments.reproduce.dgc --config {args.config} "
                  f"(--report-only rebuilds it from the records) -->\n{text}")
    plot(results, args.out_dir / f"dgc_{args.config}.png", f"DGC reproduction ({args.config})")
    if args.readme:
        from experiments.results_table import update_readme

        update_readme(args.readme, text, f"dgc_{args.config}")
    print(text, end="")
    return {name: [s for _, s in runs] for name, runs in results.items()}


if __name__ == "__main__":
    main()
