"""DiLoCo and Streaming DiLoCo on a character-level transformer (Tiny Shakespeare), 4 workers, on CPU.

    python -m experiments.reproduce.diloco                        # 10 runs, ~35 min on a 2-core CPU
    python -m experiments.reproduce.diloco --config.train.steps=100 --rows data-parallel diloco   # a quick look
    python -m experiments.reproduce.diloco --publish --report-only   # the committed table

The settings are ml_collections config ``experiments/configs/diloco_tiny_shakespeare.py``
(``--config FILE`` names another; ``--config.KEY=VALUE`` overrides a key).
Rows (every one the same model, data, steps, seed and inner learning-rate schedule):

* **data-parallel**: AdamW on the gradients averaged every step (``cj.identity``: float32 all-reduce);
* **DiLoCo, H = 50**: ``cj.diloco(adamw, sync_every=50)``, outer Nesterov SGD (lr 0.7, momentum 0.9),
  float32 outer gradients (Douillard et al. 2023);
* **Streaming DiLoCo**: its own H = 13, 4 fragments (offsets 0, 3, 6 and 9), overlap τ = 1, α = 0.5, outer
  Nesterov lr 1.0, outer gradients sent as 4-bit E3M0 without error feedback (Douillard et al. 2025);
* **Streaming DiLoCo, sharded**: the same run on a 4 × 2 mesh, each worker a host of 2 devices over which its
  parameters, AdamW moments and outer state are sharded (``parallel.fsdp_specs``) and its batch is split: the
  same numbers up to float rounding, half the state per device (``config.fsdp_fast``);
* **DiLoCo + top-k**: H = 50, outer gradients through ``cj.topk(0.05)`` with error feedback;
* **SparseLoCo**: ``cj.sparseloco(adamw, sync_every=15)`` (and H = 50): the top 128 entries of each 64 x 64
  tile of a decayed error-feedback accumulator (β = 0.95), 2-bit values, 12-bit tile-local indices, plain outer
  descent (lr 1, no momentum), each entry averaged over the workers that sent it (Sarfi et al. 2025);
* **DeMo**: ``cj.demo`` per step, no inner optimizer: the top 32 DCT coefficients of each 64 x 64 tile of the
  momentum (β = 0.999), float32 values, sign update at AdamW's schedule (Peng et al. 2024);
* **DiLoCo, Muon inner**: H = 50, ``optax.contrib.muon`` as the inner optimizer (lr 0.02 for the matrices,
  AdamW's schedule for the rest), and **data-parallel with Muon**, its synchronous reference.

Reported: final validation loss (nats per character) of the global model (the DiLoCo rows: the outer
parameters, ``cj.diloco_global_params``; the data-parallel rows: the parameters every worker holds), of the
workers' mean parameters and of worker 0's, the total bytes one worker put into collectives
(``cj.payload_bytes`` read every step, so what was really sent), the peak bytes in any one step, and the
bytes ratio vs data-parallel.  Writes
``<out>/diloco_tiny_shakespeare.{md,json,png}`` (the JSON with the command, the full config and
provenance) and one record per run under ``<out>/diloco/`` (``--report-only`` rebuilds the table from
them), where ``<out>`` is ``runs/reproduce`` (git-ignored), with ``--publish``
``experiments/results/reproduce`` (the committed results), or ``--out-dir``.
"""

from __future__ import annotations

from experiments.cpu_devices import force_cpu_devices

force_cpu_devices(8)

import json
from pathlib import Path

from experiments import records
from experiments.reproduce import common

NAME = "diloco_tiny_shakespeare"
PROG = "python -m experiments.reproduce.diloco"
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / f"{NAME}.py"
ROWS = ("data-parallel", "diloco", "streaming", "streaming-fsdp", "diloco-topk", "sparseloco", "sparseloco-h50", "demo",
        "diloco-muon", "data-parallel-muon")


def labels(config) -> dict[str, str]:
    """Row -> its label in the table and the plot."""
    h, st = config.sync_every, config.streaming
    return {
        "data-parallel": "data-parallel (AdamW, fp32 all-reduce every step)",
        "diloco": f"DiLoCo, H = {h} (fp32 outer gradients)",
        "streaming": f"Streaming DiLoCo, H = {streaming_h(config)}, {st.fragments} fragments, τ = {st.overlap}, E3M0",
        "streaming-fsdp": (f"the same, each worker's parameters and state sharded over {config.fsdp_fast} devices "
                           f"(FSDP, {config.train.workers} × {config.fsdp_fast} mesh)"),
        "diloco-topk": f"DiLoCo, H = {h}, top-k {100 * config.topk_ratio:g}% + error feedback",
        "sparseloco": sparseloco_label(config, config.sparseloco.sync_every),
        "sparseloco-h50": sparseloco_label(config, h),
        "demo": (f"DeMo (per step), top {config.demo.k} DCT coefficients of each {config.demo.chunk}×{config.demo.chunk}"
                 f" tile, {config.demo['values']} values, sign update"),
        "diloco-muon": f"DiLoCo, H = {h}, Muon inner",
        "data-parallel-muon": "data-parallel (Muon, fp32 all-reduce every step)",
    }


def sparseloco_label(config, h: int) -> str:
    sl = config.sparseloco
    return (f"SparseLoCo, H = {h}, top-{sl.k} of each {sl.chunk}×{sl.chunk} tile ({100 * sl.k / sl.chunk**2:.2g}%), "
            f"{sl.value_bits}-bit values, β = {sl.decay:g}")


def streaming_h(config) -> int:
    """The Streaming DiLoCo row's H: ``config.streaming.sync_every``, or the DiLoCo rows' ``config.sync_every``."""
    return config.streaming.get("sync_every") or config.sync_every


def warmup(config, steps: int) -> int:
    """``config.warmup_steps``, or a quarter of a shorter run."""
    return min(config.warmup_steps, steps // 4)


def schedule(config, steps: int, peak: float | None = None):
    """Linear warm-up to ``peak`` (default ``config.lr``), cosine decay to ``peak / 10`` at the last step."""
    import optax

    peak = config.lr if peak is None else peak
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup(config, steps), steps, end_value=peak / 10)


def make_tx(row: str, config):
    """``axis_name -> transform`` for ``row``."""
    import optax

    import compjax as cj

    steps, h, st = config.train.steps, config.sync_every, config.streaming
    sched = schedule(config, steps)

    def build(ax):
        adamw = optax.adamw(sched, weight_decay=config.weight_decay)
        if row == "data-parallel":
            return optax.chain(cj.identity(axis_name=ax), adamw)
        if row == "diloco":
            return cj.diloco(adamw, sync_every=h, axis_name=ax)
        if row in ("streaming", "streaming-fsdp"):
            return cj.diloco(adamw, sync_every=streaming_h(config), fragments=st.fragments, overlap=st.overlap, alpha=st.alpha,
                             outer=optax.sgd(st.outer_lr, momentum=0.9, nesterov=True),
                             compressor=cj.e3m0(error_feedback=False, skip_nonfinite=False, axis_name=ax),
                             axis_name=ax)
        if row == "diloco-topk":
            return cj.diloco(adamw, sync_every=h,
                             compressor=cj.topk(config.topk_ratio, skip_nonfinite=False, axis_name=ax), axis_name=ax)
        if row in ("sparseloco", "sparseloco-h50"):
            sl = config.sparseloco
            return cj.sparseloco(adamw, sync_every=sl.sync_every if row == "sparseloco" else h, k=sl.k,
                                 chunk=sl.chunk, value_bits=sl.value_bits, decay=sl.decay, outer_lr=sl.outer_lr,
                                 aggregate=sl.aggregate, axis_name=ax)
        if row == "demo":
            d = config.demo
            return cj.demo(schedule(config, steps, d.lr), decay=d.decay, k=d.k, chunk=d.chunk,
                           weight_decay=d.weight_decay, values=d["values"], axis_name=ax)
        muon = optax.contrib.muon(schedule(config, steps, config.muon_lr), adam_learning_rate=sched)
        if row == "diloco-muon":
            return cj.diloco(muon, sync_every=h, axis_name=ax)
        if row == "data-parallel-muon":
            return optax.chain(cj.identity(axis_name=ax), muon)
        raise ValueError(f"row must be one of {ROWS}, got {row!r}")

    return build


def run(row: str, config) -> dict:
    """One row's training run (:func:`experiments.lm.train.train` with ``config.train``)."""
    from experiments.lm.train import train

    kwargs = config.train.to_dict()
    if row == "streaming-fsdp":  # each worker a host of fsdp_fast devices, the host's batch split over them
        fast, per = config.fsdp_fast, kwargs["batch_per_worker"]
        if fast < 1 or per % fast:
            raise SystemExit(f"{PROG}: fsdp_fast = {fast} must be >= 1 and divide batch_per_worker = {per}")
        kwargs.update(mesh=f"{kwargs['workers']}x{fast}", fsdp=True, batch_per_worker=per // fast)
    res = train(make_tx(row, config), log=print, **kwargs)
    res["row"] = row
    return res


#: The synchronous run each row is compared with (same inner optimizer).
REFERENCE = {"diloco-muon": "data-parallel-muon", "data-parallel-muon": "data-parallel-muon"}


def global_loss(r: dict) -> list[float]:
    """A run's validation losses of its global model, at its ``eval_step``s.

    DiLoCo rows: ``val_loss_global`` (the outer parameters, ``cj.diloco_global_params``); rows without a
    DiLoCo state (``val_loss_global`` None, or absent from a data-parallel row's older record: workers that all
    hold the same parameters): the workers' mean.  A DiLoCo row's record written before ``val_loss_global``
    existed stops the script (run that row again).
    """
    if r.get("val_loss_global") is not None:
        return r["val_loss_global"]
    if "val_loss_global" not in r and not str(r.get("row", "")).startswith("data-parallel"):
        raise SystemExit(f"{PROG}: the record of row {r.get('row')!r} has no val_loss_global (written before the "
                         "global model was evaluated): run that row again")
    return r["val_loss_mean"]


def summarize(results: dict[str, dict], config) -> list[dict]:
    """One dict per row: final losses, the global model's vs the row's reference (%), bytes and their ratio."""
    label = labels(config)
    rows = []
    for row in ROWS:
        if row not in results:
            continue
        r = results[row]
        ref = results.get(REFERENCE.get(row, "data-parallel"))
        ref_loss = global_loss(ref)[-1] if ref else None
        loss = global_loss(r)[-1]
        ref_bytes = ref["total_bytes"] if ref else None
        rows.append({
            "row": row, "label": label[row], "reference": REFERENCE.get(row, "data-parallel"),
            "val_loss_global": loss, "val_loss_mean": r["val_loss_mean"][-1],
            "val_loss_worker0": r["val_loss_worker0"][-1],
            "vs_dp_pct": 100 * (loss / ref_loss - 1) if ref_loss else None,
            "total_bytes": r["total_bytes"], "peak_bytes": r["peak_bytes"],
            "bytes_ratio": ref_bytes / r["total_bytes"] if ref_bytes and r["total_bytes"] else None,
            "syncing_steps": sum(1 for b in r["payload_bytes"] if b), "steps": r["config"]["steps"],
            "wall_s": r["wall_s"],
        })
    return rows


def table(rows: list[dict], config) -> str:
    t, lr = config.train, config.lr
    head = (f"Tiny Shakespeare, character-level transformer ({t.model_config} config), "
            f"{t.workers} workers × {t.batch_per_worker} windows of {t.seq_len} "
            f"characters, {t.steps} steps, AdamW lr {lr:g} (warm-up {config.warmup_steps}, cosine to {lr / 10:g}), "
            f"weight decay {config.weight_decay:g}. Validation loss in nats per character on the last 10% of the text, of the "
            f"global model (DiLoCo: the outer parameters, `cj.diloco_global_params`; data-parallel: every worker's), "
            f"the workers' mean and worker 0; bytes are what one worker put into collectives (`cj.payload_bytes`, read "
            f"every step).\n\n")
    lines = [("| run | val loss (global model) | val loss (mean of workers) | val loss (worker 0) | "
              "vs data-parallel (global model, same inner optimizer) | total bytes/worker | fewer bytes than DP | "
              "peak bytes in one step | steps with a collective | wall (s) |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['bytes_ratio']:,.0f}×" if r["bytes_ratio"] else "—"
        vs = f"{r['vs_dp_pct']:+.2f}%" if r["vs_dp_pct"] is not None else "—"
        lines.append(f"| {r['label']} | {r['val_loss_global']:.4f} | {r['val_loss_mean']:.4f} | "
                     f"{r['val_loss_worker0']:.4f} | {vs} | "
                     f"{r['total_bytes']:,} | {ratio} | {r['peak_bytes']:,} | {r['syncing_steps']} | "
                     f"{r['wall_s']:.0f} |")
    return head + "\n".join(lines) + "\n"


def plot(results: dict[str, dict], path: Path, config) -> None:
    import numpy as np

    label = labels(config)
    with common.figure(path, figsize=(11, 4), dpi=110, nrows=1, ncols=2) as (_, (a, b)):
        for row in ROWS:
            if row not in results:
                continue
            r = results[row]
            loss = global_loss(r)
            a.plot(r["eval_step"], loss, marker="o", label=label[row])
            cum = np.cumsum([0] + r["payload_bytes"])
            b.plot([max(cum[s], 1) for s in r["eval_step"]], loss, marker="o", label=label[row])
        a.set_xlabel("step")
        a.set_ylabel("validation loss (nats/char, global model)")
        b.set_xscale("log")
        b.set_xlabel("bytes sent per worker so far")
        a.legend(fontsize=7)
        a.set_title("loss vs step")
        b.set_title("loss vs bytes")


def main(argv=None) -> list[dict]:
    p = common.parser(PROG, __doc__, DEFAULT_CONFIG, "--config.train.steps=100",
                      report_only="rebuild the table and plot from the records")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS, help="which runs (default: all)")
    head = common.parse(p, argv, DEFAULT_CONFIG)
    config, args, out, command = head.config, head.args, head.out_dir, head.command
    record_dir = out / "diloco"
    label = labels(config)
    record_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for row in ROWS:
        path = record_dir / f"{row}.json"
        if row in args.rows and not args.report_only:
            print(f"== {label[row]}")
            res = run(row, config)
            res["reproduction"] = {"command": command, "config": config.to_dict()}
            path.write_text(json.dumps(res) + "\n")
        if path.exists():
            results[row] = json.loads(path.read_text())
    if not results:
        raise SystemExit(f"{PROG}: no records under {record_dir} (run without --report-only first; the committed "
                         "records are read with --publish)")
    rows = summarize(results, config)
    text = table(rows, config)
    (out / f"{NAME}.md").write_text(f"<!-- generated by: {PROG} -->\n{text}")
    summary = out / f"{NAME}.json"
    origin = {"command": command, "provenance": records.provenance(command)}
    if args.report_only and summary.exists():  # the rows' origin is the run that trained them, not this rebuild
        saved = json.loads(summary.read_text())
        origin = {k: saved[k] for k in origin if k in saved}
    summary.write_text(json.dumps({**origin, "config": config.to_dict(), "rows": rows}, indent=1) + "\n")
    plot(results, out / f"{NAME}.png", config)
    print(text)
    print(f"wrote {out / NAME}.{{md,json,png}} and the records under {record_dir}")
    return rows


if __name__ == "__main__":
    main()
