"""A results table from main-job JSONL records: one row per config, seeds averaged.

    python -m experiments.results_table [--runs DIR] [--out FILE]

Reads the summary line of every ``*.jsonl`` under ``--runs`` (default
``runs/train``, where the main job writes), writes a markdown table to
``--out`` (default ``runs/results_table.md``) and prints it.  Runs whose
configs differ only in the seed share a row: mean accuracy ± the seeds'
sample standard deviation.  Epochs and steps are those the runs trained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments import records

HERE = Path(__file__).resolve().parent
ORDER = ["identity", "cast", "topk", "randomk", "dgc", "powersgd", "onebit", "signsgd", "twobit", "terngrad", "qsgd"]


def load_summaries(runs: Path) -> list[dict]:
    """The summary record of each JSONL file in ``runs`` (files without one are skipped)."""
    out = []
    for path in sorted(runs.glob("*.jsonl")):
        summary = None
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("kind") == "summary":
                    summary = rec
        if summary is not None:
            summary["file"] = path.name
            out.append(summary)

    def key(s):
        name = s["config"]["compressor"]
        return (ORDER.index(name) if name in ORDER else len(ORDER), name, json.dumps(s["config"]["options"]))

    return sorted(out, key=key)


def epochs_and_steps(summary: dict) -> tuple[float, int]:
    """The epochs and steps a run really trained (``--max-steps`` stops a run early)."""
    c = summary["config"]
    steps = summary.get("steps_taken", summary["steps"])
    per_epoch = c.get("steps_per_epoch") or (c["train_images"] // c["batch_size"] if "train_images" in c else None)
    return (steps / per_epoch if per_epoch else c["epochs"]), steps


def group_seeds(summaries: list[dict]) -> list[list[dict]]:
    """Runs that differ only in their seed, grouped (in order of first appearance)."""
    groups: dict[str, list[dict]] = {}
    for s in summaries:
        key = json.dumps({k: v for k, v in s["config"].items() if k not in ("seed", "backend")}, sort_keys=True)
        groups.setdefault(key, []).append(s)
    return list(groups.values())


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    m = sum(values) / len(values)
    sd = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return m, sd


def table(summaries: list[dict]) -> str:
    """A markdown table of the runs, one row per config; runs that differ only in the seed share a row.

    Accuracy is the mean over the row's seeds ± their sample standard
    deviation; deltas are against the identity row of as many epochs, if any.
    """
    rows = []
    for group in group_seeds(summaries):
        acc, sd = mean_spread([s["test_accuracy"] for s in group])
        rows.append((group, acc, sd))
    bases = {}  # epochs -> accuracy of the (first) identity row of that length
    for group, acc, _ in rows:
        if group[0]["config"]["compressor"] == "identity":
            bases.setdefault(epochs_and_steps(group[0]), acc)
    lines = [
        ("| compressor | options | test accuracy | seeds | Δ vs identity (points) | payload bytes/step/worker | "
         "compression ratio | epochs | steps | lr | momentum | workers | wall time (s) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for group, acc, sd in rows:
        s, c = group[0], group[0]["config"]
        opts = ", ".join(f"{k}={v}" for k, v in c["options"].items()) or "—"
        if c.get("lr_before_compressor"):
            opts += " (lr before compressor)"
        epochs, steps = epochs_and_steps(s)
        base = bases.get((epochs, steps))
        delta = f"{100 * (acc - base):+.2f}" if base is not None else "—"
        nbytes = sum(r["payload_bytes_mean_per_step"] for r in group) / len(group)
        ratio = f"{s['dense_bytes_per_step'] / nbytes:.1f}×" if nbytes and "dense_bytes_per_step" in s else (
            f"{s['compression_ratio']:.1f}×" if s.get("compression_ratio") else "—")
        accuracy = f"{100 * acc:.2f}%" + (f" ± {100 * sd:.2f}" if len(group) > 1 else "")
        seeds = ", ".join(str(r["config"].get("seed", "—")) for r in group)
        wall = sum(r["wall_s"] for r in group) / len(group)
        lines.append(
            f"| {c['compressor']} | {opts} | {accuracy} | {seeds} | {delta} | {nbytes:,.0f} | {ratio} | "
            f"{epochs:g} | {steps} | {c.get('lr', '—')} | {c.get('momentum', '—')} | {c['workers']} | {wall:.0f} |"
        )
    note = ("Accuracy: mean over the seeds listed ± their sample standard deviation. Epochs and steps: what the "
            "runs trained.\n\n")
    return note + "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=records.RUNS / "train",
                   help="folder of JSONL records (default: runs/train, where the main job writes)")
    p.add_argument("--out", type=Path, default=records.RUNS / "results_table.md",
                   help="markdown file (default: runs/results_table.md)")
    args = p.parse_args(argv)
    summaries = load_summaries(args.runs)
    if not summaries:
        raise SystemExit(f"no run summaries under {args.runs}")
    text = table(summaries)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m experiments.results_table", *(argv if argv is not None else sys.argv[1:])])
    args.out.write_text(f"<!-- generated by: {command} -->\n" + text)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
