"""The results summary table of README.md and docs/results/index.md, built from the committed records.

    .venv/bin/python docs/results_summary.py            # rewrite the table in both files
    .venv/bin/python docs/results_summary.py --check    # exit 1 if either is stale

One row per method and setting of each reproduction: how many times fewer bytes than its dense baseline
it sent, how far its accuracy or loss ended from that baseline, and a link to the results page that has
the full table, the plot and the command.  It reads the records the reproductions publish under
``experiments/results/`` (``--publish``): the main job's and the DGC reproduction's JSONL summaries, and
the JSON of the Delayed Gradient Averaging, DiLoCo and federated reproductions.  The table sits between
``<!-- results:summary:start -->`` and ``<!-- results:summary:end -->``; ``tests/test_readme_results.py``
checks that both copies equal what this script builds now.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "reproduce"
PAGES = ROOT / "docs" / "results"
#: the files that hold the table
TARGETS = (ROOT / "README.md", PAGES / "index.md")
START, END = "<!-- results:summary:start -->", "<!-- results:summary:end -->"

#: main-job compressor -> (method name, options shown in the setting column)
MAIN_JOB = {
    "cast": ("bfloat16 cast", ("dtype",)),
    "topk": ("top-k + error feedback", ("ratio",)),
    "randomk": ("random-k + error feedback", ("ratio",)),
    "dgc": ("DGC", ("ratio",)),
    "powersgd": ("PowerSGD", ("rank",)),
    "onebit": ("1-bit SGD", ()),
    "signsgd": ("EF-signSGD", ()),
    "twobit": ("MXNet 2-bit", ("threshold",)),
    "terngrad": ("TernGrad", ()),
    "qsgd": ("QSGD", ("levels",)),
}
#: DiLoCo reproduction row -> method name
DILOCO = {
    "diloco": "DiLoCo", "streaming": "Streaming DiLoCo", "diloco-topk": "DiLoCo + top-k",
    "sparseloco": "SparseLoCo", "sparseloco-h50": "SparseLoCo", "demo": "DeMo",
    "diloco-muon": "DiLoCo (Muon inner)",
}
#: federated reproduction row -> method name
#: results page -> the link's text
PAGE_LABELS = {"main_job": "main job", "dgc": "DGC", "dga": "DGA", "diloco": "DiLoCo",
               "federated": "federated"}
FEDERATED = {
    "scaffold-1msg": "SCAFFOLD, one message", "fedavg": "FedAvg", "fedavg-top1%": "FedAvg + top-k",
    "scallion-rand5%": "SCALLION", "scafcom-top1%": "SCAFCOM",
}


def summary_record(path: Path) -> dict:
    """The last ``"kind": "summary"`` line of a main-job JSONL record."""
    found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    summaries = [r for r in found if r.get("kind") == "summary"]
    if not summaries:
        raise ValueError(f"{path} has no summary line (the run did not finish)")
    return summaries[-1]


def _ratio(x: float) -> str:
    return f"{x:,.1f}×" if x < 1000 else f"{x:,.0f}×"


def _ratios(dense: float, final: float, mean: float) -> str:
    """Dense over the last step's bytes, and over the run's mean when a warm-up made them differ."""
    shown = _ratio(dense / final)
    return shown + (f" ({_ratio(dense / mean)} with warm-up)" if abs(mean - final) > 0.05 * final else "")


def _points(delta: float, base: str) -> str:
    return f"{100 * delta:+.2f} points vs {base}"


def main_job_rows() -> list[tuple]:
    runs = {}
    for path in sorted((RESULTS / "main_job").glob("*.jsonl")):
        s = summary_record(path)
        runs.setdefault(s["config"]["compressor"], []).append(s)
    base = sum(s["test_accuracy"] for s in runs["identity"]) / len(runs["identity"])
    rows = []
    for name, (method, shown) in MAIN_JOB.items():
        if name not in runs:
            continue
        group = runs[name]
        s = group[0]
        opts = s["config"]["options"]
        setting = ", ".join(f"{k}={opts[k]}" for k in shown if k in opts) or "—"
        acc = sum(r["test_accuracy"] for r in group) / len(group)
        mean = sum(r["payload_bytes_mean_per_step"] for r in group) / len(group)
        final = sum(r["payload_bytes_per_step"] for r in group) / len(group)
        c = s["config"]
        rows.append((method, setting, f"Fashion-MNIST CNN, {c['workers']} workers, {c['epochs']} epochs",
                     _ratios(s["dense_bytes_per_step"], final, mean), _points(acc - base, "dense"),
                     "main_job"))
    return rows


def dgc_rows() -> list[tuple]:
    folder = RESULTS / "dgc" / "fashion_mnist_cnn"
    runs = {}
    for path in sorted(folder.glob("*.jsonl")):
        runs.setdefault(path.stem.removesuffix("_seed1"), []).append(summary_record(path))
    base = sum(s["test_accuracy"] for s in runs["baseline"]) / len(runs["baseline"])
    rows = []
    for key, method in (("dgc", "DGC"), ("gradient_dropping", "gradient dropping (top-k + EF)")):
        group = runs[key]
        s = group[0]
        acc = sum(r["test_accuracy"] for r in group) / len(group)
        mean = sum(r["payload_bytes_mean_per_step"] for r in group) / len(group)
        final = sum(r["payload_bytes_per_step"] for r in group) / len(group)
        c = s["config"]
        rows.append((method, f"ratio={c['options']['ratio']}",
                     f"Fashion-MNIST CNN, {c['workers']} workers, {c['epochs']} epochs, {len(group)} seeds",
                     _ratios(s["dense_bytes_per_step"], final, mean), _points(acc - base, "dense"), "dgc"))
    return rows


def dga_rows(delay: int = 10) -> list[tuple]:
    rows = []
    dense = None
    for name in ("dga_fashion_mnist_cnn", "dga_fashion_mnist_cnn_k20"):
        saved = json.loads((RESULTS / f"{name}.json").read_text())
        period = saved.get("period", 1)
        by_delay = {r["delay"]: r for r in saved["rows"]}
        dense = dense or by_delay[0]["bytes"]  # synchronous SGD's bytes per step (K = 1 comes first)
        row, base = by_delay[delay], by_delay[0]
        versus = "synchronous SGD" if period == 1 else f"local SGD (K = {period})"
        every = "every step" if period == 1 else f"every {period} steps"
        workers = saved["config"]["train"].get("workers") or 8  # None: every device (8 in these runs)
        rows.append(("Delayed Gradient Averaging", f"D = {delay}, averaging {every}",
                     f"Fashion-MNIST CNN, {workers} workers, {row['epochs']:g} epochs",
                     _ratio(dense / row["bytes"]),
                     _points(row["accuracy"] - base["accuracy"], versus), "dga"))
    return rows


def diloco_rows() -> list[tuple]:
    saved = json.loads((RESULTS / "diloco_tiny_shakespeare.json").read_text())
    train = saved["config"]["train"]
    rows = []
    for r in saved["rows"]:
        if r["row"] not in DILOCO:
            continue
        setting = r["label"].split(", ", 1)[1] if ", " in r["label"] else "—"
        base = "data-parallel" + (" Muon" if "muon" in r["reference"] else "")
        rows.append((DILOCO[r["row"]], setting,
                     f"Tiny Shakespeare transformer, {train['workers']} workers, {train['steps']} steps",
                     _ratio(r["bytes_ratio"]), f"{r['vs_dp_pct']:+.2f}% val loss vs {base}", "diloco"))
    return rows


def federated_rows() -> list[tuple]:
    saved = json.loads((RESULTS / "federated_fashion_mnist.json").read_text())
    st = saved["settings"]
    by_row = {r["row"]: r for r in saved["summary"]}
    base = by_row["scaffold"]
    rows = []
    for key, method in FEDERATED.items():
        if key not in by_row:
            continue
        r = by_row[key]
        setting = f"{r['uplink'][0]} {r['uplink'][1]:g} uplink" if r["uplink"] else "float32 uplink"
        rows.append((method, setting,
                     (f"Fashion-MNIST, {st['num_clients']} clients, {st['rounds']} rounds, "
                      f"{len(st['seeds'])} seeds"),
                     _ratio(r["uplink_ratio_per_round"] / base["uplink_ratio_per_round"]),
                     _points(r["accuracy"] - base["accuracy"], "SCAFFOLD"), "federated"))
    return rows


def table(link_prefix: str = "docs/results/") -> str:
    """The summary table in markdown; links are ``link_prefix + page + ".md"``."""
    lines = [
        ("Fewer bytes: the dense baseline's bytes per worker (per client uplink for federated rows) over the "
         "method's. Quality: final test accuracy, or validation loss, against the baseline named."),
        "",
        "| method | setting | testbed | fewer bytes | quality | details |",
        "|---|---|---|---|---|---|",
    ]
    for method, setting, testbed, ratio, quality, page in (
            main_job_rows() + dgc_rows() + dga_rows() + diloco_rows() + federated_rows()):
        link = f"[{PAGE_LABELS.get(page, page)}]({link_prefix}{page}.md)"
        lines.append(f"| {method} | {setting} | {testbed} | {ratio} | {quality} | {link} |")
    return "\n".join(lines) + "\n"


def prefix_for(target: Path) -> str:
    """The relative path from ``target``'s folder to docs/results/, ending in ``/`` (empty beside it)."""
    rel = os.path.relpath(PAGES, target.resolve().parent)
    return "" if rel == "." else rel.replace(os.sep, "/") + "/"


def block(text: str) -> str | None:
    """The summary block of a file's text (None when it has none)."""
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].removeprefix("\n")


def replace_block(text: str, table_text: str, where: Path) -> str:
    if block(text) is None:
        raise SystemExit(f"{where} has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{table_text}{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a file's table differs from the records")
    p.add_argument("files", nargs="*", type=Path, default=list(TARGETS), help="files holding the table")
    args = p.parse_args(argv)
    stale = []
    for path in args.files:
        text = path.read_text()
        new = replace_block(text, table(prefix_for(path)), path)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{path}: {'stale' if args.check else 'rewritten'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
