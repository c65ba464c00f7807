"""Delayed Gradient Averaging (Zhu et al., NeurIPS 2021) in shape: accuracy and modeled wall-clock time vs delay.

    python -m experiments.reproduce.dga                       # Fashion-MNIST CNN, 8 workers, D = 0, 2, 5, 10, 20
    python -m experiments.reproduce.dga --config.train.epochs=1 --delays 0,5   # shorter
    python -m experiments.reproduce.dga --publish --report-only   # the committed table
    python -m experiments.reproduce.dga --stability   # the deviation bound per delay (no training)
    python -m experiments.reproduce.dga --config.train.compressor.period=20   # average every K = 20 steps

One main-job run (:func:`experiments.train.run_config`, compressor ``dga``) per
delay, with the settings of ``experiments/configs/dga_fashion_mnist_cnn.py``
(``train``: the main-job config of every run); with the default period
``K = 1`` delay 0 is synchronous data-parallel SGD, with ``K > 1`` it is local
SGD that averages the models every ``K`` steps (FedAvg with every client
taking part), the paper's baseline.  Records go under ``<out>/dga/``
(``<out>/dga_k<K>/`` for ``K > 1``), the table to ``<out>/dga_fashion_mnist_cnn.md``
(``..._k<K>.md``) and the accuracy-vs-time plot beside it,
where ``<out>`` is ``runs/reproduce`` (git-ignored), or with ``--publish``
``experiments/results/reproduce`` (the committed results).

**The time model** (printed with the table), per step of ``n = 8`` workers on the
network preset (WAN: Mumbai–San Francisco):

* ``compute`` -- the measured time of one worker's forward and backward pass on
  its local batch on this machine (:func:`compjax.netmodel.measure_compute_time`);
* ``comm`` -- the alpha–beta time of the step's collectives as audited from the
  compiled step (:func:`compjax.audit_collectives`, :func:`compjax.netmodel.predict_step`):
  latency ``2 (n-1) alpha`` of a ring all-reduce plus its bytes over the bandwidth.
  The runs have no non-finite guard (``--no-skip-nonfinite``): its vote is an
  all-reduce on the current gradient, synchronous by nature, as costly in
  latency as the exchange itself on this link, and the paper has none;
* one exchange every ``K`` steps (the period; 1 by default);
* delay 0: ``compute + comm / K`` (synchronous SGD with ``K = 1``: ``compute + comm``);
* the paper's system (an exchange may take up to ``D`` further steps, sent by a
  communication thread; a step that receives an average waits for what ``D + 1``
  steps of compute did not hide, shared among the ``1 + D // K`` arrivals in
  ``D + 1`` steps; the link carries one exchange's bytes per ``K`` steps):
  ``max(compute + max(0, comm - (D + 1) compute) / ((1 + D // K) K), comm_bytes / K)``,
  ``comm_bytes`` the bandwidth part (with ``K = 1``: ``max(compute, comm / (D + 1), comm_bytes)``);
* compjax's single-program step, where the delayed exchange is issued inside step
  ``t`` and overlaps that step's computation only: ``((K - 1) compute + max(compute, comm)) / K``
  for any ``D >= 1``.

The modeled run time is the number of steps times the step time.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments import config_cli, train  # train first: 8 simulated CPU devices before JAX starts
from experiments.reproduce import common
from experiments.reproduce.dgc import read_records

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "dga_fashion_mnist_cnn.py"
PROG = "python -m experiments.reproduce.dga"
NAME = "dga_fashion_mnist_cnn"
WORKERS = 8


def load_config(overrides=()):
    """The ``ml_collections.ConfigDict`` of the reproduction, with ``--config.KEY=VALUE`` ``overrides``."""
    return config_cli.load(DEFAULT_CONFIG, list(overrides), prog=PROG)


def period_of(config) -> int:
    """The period ``K`` of every run of ``config``: ``config.train.compressor.period`` (1 if unset)."""
    return int(config.train.compressor.get("period", 1))


def names(config) -> tuple[str, str]:
    """``(table name, record folder)``: ``dga_fashion_mnist_cnn``, ``dga`` for ``K = 1``; ``..._k<K>``, ``dga_k<K>`` else."""
    k = period_of(config)
    return (NAME, "dga") if k == 1 else (f"{NAME}_k{k}", f"dga_k{k}")


def row_bytes(summary: dict, period: int) -> int:
    """Bytes per step and worker of a run: the last step's (the steady state) with ``K = 1``, else the run's mean."""
    return summary["payload_bytes_per_step"] if period == 1 else round(summary["payload_bytes_mean_per_step"])


def run_config(config, delay: int):
    """The main-job config of the run with ``delay``: ``config.train`` with ``compressor.delay = delay``."""
    cfg = train.default_config()
    cfg.update_from_flattened_dict(config_cli.flatten(config.train))
    cfg.compressor.delay = delay
    return cfg


def audited_and_compute(config, delay: int, workers: int = WORKERS, *, measure: bool = True):
    """The collectives of the main job's compiled step with ``delay`` (steady state) and one worker's compute time.

    Returns ``(collectives, compute_s)``: the audit of the data-parallel step as
    the main job builds it, and the median seconds of one worker's forward and
    backward pass on its ``batch_size / workers`` images (None unless ``measure``).
    """
    import jax
    import numpy as np

    from compjax import audit_collectives, netmodel, parallel
    from experiments import models, trainer

    cfg = run_config(config, delay)
    params, _, loss_fn = models.build(0, model="cnn")
    mesh = parallel.make_mesh(workers)
    steps = 60_000 // cfg.batch_size * cfg.epochs
    compressor, _ = trainer.build_compressor(cfg, "data")
    tx = trainer.guard(cfg, trainer.transform(cfg, compressor, steps), "data")  # no guard: skip_nonfinite off
    step = parallel.data_parallel_step(loss_fn, tx, mesh)
    rng = np.random.default_rng(0)
    x = rng.random((cfg.batch_size, 28, 28, 1), np.float32)
    y = rng.integers(0, 10, cfg.batch_size)
    ops = audit_collectives(step, parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh),
                            parallel.shard_batch((x, y), mesh))
    local = (x[: cfg.batch_size // workers], y[: cfg.batch_size // workers])
    compute_s = netmodel.measure_compute_time(jax.jit(jax.grad(loss_fn)), params, local, repeats=20) if measure else None
    return ops, compute_s


def model_step(ops, delay: int, network, compute_s: float, workers: int = WORKERS, period: int = 1) -> dict[str, float]:
    """Seconds per step under the module docstring's model: without delay, the paper's pipelining, compjax's in-step overlap.

    ``ops``: the collectives of one exchange (a step that sends); ``period``: one
    exchange every ``period`` steps.  ``comm`` is the time of one exchange.
    """
    from compjax import netmodel

    comm = netmodel.predict_step(ops, workers, network, compute_s).comm_s
    comm_bytes = netmodel.predict_step(ops, workers, netmodel.Network(network.bandwidth, 0.0), compute_s).comm_s
    if delay == 0:
        return {"comm": comm, "paper": compute_s + comm / period, "in_step": compute_s + comm / period}
    arrivals = 1 + delay // period  # steps that receive an average among any D + 1 consecutive ones
    wait = max(0.0, comm - (delay + 1) * compute_s) / arrivals  # what D + 1 steps of compute do not hide
    return {"comm": comm, "paper": max(compute_s + wait / period, comm_bytes / period),
            "in_step": ((period - 1) * compute_s + max(compute_s, comm)) / period}


def deviation_threshold(momentum: float, delay: int, period: int = 1, *, step: float = 0.01,
                        tol: float = 1e-4) -> float:
    """The largest ``eta * lambda`` for which the workers' deviations from their average stay bounded under DGA.

    One direction of curvature ``lambda`` of a quadratic, learning rate ``eta``,
    heavy-ball momentum ``beta`` after the delayed correction (the main job's
    chain).  The part of each update that is the same on every worker cancels, so
    a worker's deviation ``d = w_i - mean_j w_j`` and ``M = eta * (m_i - mean_j m_j)``
    follow, with ``a = eta * lambda``::

        M_{t+1} = beta * M_t + a * (d_t - [t = pK + K - 1 + D] * sum_{s = pK}^{pK + K - 1} d_s)
        d_{t+1} = d_t - M_{t+1}

    (the local gradient enters at once and leaves when its period's average
    arrives; with ``period = 1`` the bracket is ``d_{t-D}`` at every step).
    The map over one period is linear; its mode ``z = 1`` (a constant
    deviation, which no gradient difference excites) is left out, the others
    must lie inside the unit circle.  With ``delay = 0`` and ``period = 1`` there
    is no deviation: the function returns the bound of synchronous heavy ball,
    ``2 (1 + beta)``.  With ``beta = 0, period = 1`` the bound is 1 for every
    ``D >= 1`` (the other roots of ``z^(D+1) + (a - 1) z^D - a`` multiply to
    modulus ``a``).  At ``beta = 0.9`` a period ``K = 20`` restores most of the
    synchronous range for ``D <= 10`` (2.7 for ``D = 2`` or 5, 1.8 for ``D = 10``),
    not for ``D = K`` (0.015 for ``D = 20``; 0.05 for ``D = K = 10``).

    Args:
      momentum: ``beta`` in [0, 1).
      delay: ``D``, an integer >= 0.
      period: ``K``, an integer >= 1.
      step: the scan's step in ``a``, then bisection to ``tol``.

    Returns:
      The first ``a`` (dimensionless) at which a mode stops decaying, at most 8.
    """
    import numpy as np

    if delay == 0 and period == 1:
        return 2.0 * (1.0 + momentum)
    n = delay + period + 1  # d_t, ..., d_{t-D-K+1}, M_t

    def radius(a):
        mono = np.eye(n)
        for phase in range(period):
            row = np.zeros(n)  # M_{t+1} = beta M_t + a (d_t - correction)
            row[0], row[-1] = a, momentum
            if (phase - delay + 1) % period == 0:  # t - D ends a period
                row[delay:delay + period] -= a
            m = np.zeros((n, n))
            m[-1] = row
            m[0] = -row
            m[0, 0] += 1.0
            for i in range(1, n - 1):
                m[i, i - 1] = 1.0
            mono = m @ mono
        ev = np.linalg.eigvals(mono)
        ev = np.delete(ev, np.argmin(np.abs(ev - 1.0)))
        return np.abs(ev).max()

    lo = 0.0
    for a in np.arange(step, 8.0 + step / 2, step):
        if radius(a) >= 1.0:
            hi = a
            break
        lo = a
    else:
        return 8.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if radius(mid) < 1.0 else (lo, mid)
    return float(lo)


def stability_text(momentum: float, delays, period: int = 1) -> str:
    """One line per delay: :func:`deviation_threshold` at ``momentum`` and ``period``, and its fraction of the synchronous bound."""
    sync = deviation_threshold(momentum, 0)
    every = "every step" if period == 1 else f"every {period} steps"
    lines = [(f"Momentum {momentum:g} after the delayed correction, averaging {every}: a worker's deviation from the "
              f"workers' average stays bounded while eta * lambda is below (synchronous heavy ball: {sync:.2f})")]
    for d in delays:
        if d or period > 1:
            thr = deviation_threshold(momentum, d, period)
            lines.append(f"  D = {d}: {thr:.3f} ({thr / sync:.1%} of the synchronous bound)")
    return "\n".join(lines)


def table(rows: list[dict], network_name: str, compute_s: float, period: int = 1) -> str:
    """The markdown table of ``rows``; speedups against synchronous SGD (``sync_*``: its modeled step, ``K = 1, D = 0``)."""
    base = next(r for r in rows if r["delay"] == 0)
    if period == 1:
        schedule = "Averaging every step (K = 1): D = 0 is synchronous data-parallel SGD."
        local = "its own last D local gradients"
    else:
        schedule = (f"Averaging every K = {period} steps: D = 0 is local SGD (FedAvg with every worker taking part); "
                    "bytes/step are the run's mean, comm the time of one exchange.")
        local = "its own local gradients since the last period that has arrived"
    lines = [
        (f"Network `{network_name}`, {WORKERS} workers; compute {1e3 * compute_s:.1f} ms/step (one worker's forward "
         "and backward pass, measured on this CPU); communication from the audited step. " + schedule +
         " Test accuracy of the workers' average model (with D > 0 each worker has also applied " + local +
         ", whose averages are still in flight; worker 0's own model beside it). Speedups are against synchronous SGD."),
        "",
        ("| delay D | test accuracy | Δ vs D = 0 (points) | worker 0's model | bytes/step/worker | "
         "modeled comm (ms/step) | modeled step, paper's system (ms) | modeled run, paper's system (s) | speedup | "
         "modeled step, in-step overlap (ms) | speedup (in-step) | epochs | steps |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        own = r.get("accuracy_worker0")
        lines.append(
            f"| {r['delay']} | {100 * r['accuracy']:.2f}% | {100 * (r['accuracy'] - base['accuracy']):+.2f} | "
            f"{'same' if own is None else f'{100 * own:.2f}%'} | "
            f"{r['bytes']:,} | {1e3 * r['comm']:.1f} | {1e3 * r['paper']:.1f} | {r['paper'] * r['steps']:.0f} | "
            f"{r['sync_paper'] / r['paper']:.2f}× | {1e3 * r['in_step']:.1f} | {r['sync_in_step'] / r['in_step']:.2f}× | "
            f"{r['epochs']:g} | {r['steps']} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Test accuracy against modeled wall-clock time (both models), one point per delay."""
    with common.figure(path, figsize=(6, 4)) as (_, ax):
        for key, label, marker in (("paper", "paper's system (exchange may take D steps)", "o"),
                                   ("in_step", "compjax in-step overlap", "s")):
            xs = [r[key] * r["steps"] / 60 for r in rows]
            ax.plot(xs, [100 * r["accuracy"] for r in rows], marker=marker, linestyle="", label=label)
            for r, x in zip(rows, xs):
                ax.annotate(f"D={r['delay']}", (x, 100 * r["accuracy"]), fontsize=8, xytext=(3, 3),
                            textcoords="offset points")
        common.finish_axes(ax, "modeled wall-clock time (minutes, log scale)", "test accuracy (%)", title, log_x=True,
                           legend_size=8)


def main(argv=None) -> list[dict]:
    p = common.parser(PROG, __doc__, DEFAULT_CONFIG, "--config.train.epochs=1 for every run",
                      report_only="only rebuild the table and plot from the records")
    p.add_argument("--delays", default="", help="comma-separated delays to (re)run (default: the config's)")
    p.add_argument("--stability", action="store_true",
                   help="only print, per delay, the eta*lambda below which the workers' deviations stay bounded")
    head = common.parse(p, argv, DEFAULT_CONFIG)
    config, args, out_dir = head.config, head.args, head.out_dir
    period = period_of(config)
    if args.stability:
        print(stability_text(config.train.momentum, config.delays, period))
        return []
    name, folder = names(config)
    from compjax import netmodel

    network = netmodel.Network.presets()[config.network]
    delays = [int(d) for d in args.delays.split(",")] if args.delays else list(config.delays)
    record_dir = out_dir / folder
    record_dir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for d in delays:
            train.run_config(run_config(config, d), out=record_dir / f"delay{d}.jsonl", command=head.command)
    rows, audits, compute_s = [], {}, None
    for d in sorted(config.delays):
        path = record_dir / f"delay{d}.jsonl"
        if not path.exists():
            continue
        epochs, summary = read_records(path)
        if summary is None:
            continue
        audits[d], c = audited_and_compute(config, d, measure=compute_s is None)
        if votes := [o for o in audits[d] if o.operands == (("s32", ()),)]:
            raise SystemExit(f"the audited step of D={d} holds a non-finite vote {votes}: set "
                             "config.skip_nonfinite = False (the model treats every collective as delayable)")
        compute_s = c if compute_s is None else compute_s  # one measurement for every row
        ops = audits[d]
        times = model_step(ops, d, network, compute_s, period=period)
        sync = model_step(ops, 0, network, compute_s)  # the same exchange every step, waited for
        rows.append({"delay": d, "accuracy": summary["test_accuracy"],
                     "accuracy_worker0": summary.get("test_accuracy_worker0"), "bytes": row_bytes(summary, period),
                     "steps": summary["steps"], "epochs": summary.get("epochs_run", len(epochs)), **times,
                     "sync_paper": sync["paper"], "sync_in_step": sync["in_step"]})
    if not any(r["delay"] == 0 for r in rows):
        raise SystemExit(f"no record of the delay-0 run under {record_dir}")
    text = table(rows, config.network, compute_s, period)
    flag = "" if period == 1 else f" --config.train.compressor.period={period}"
    (out_dir / f"{name}.md").write_text(
        f"<!-- generated by: python -m experiments.reproduce.dga{flag} (--report-only rebuilds it) -->\n{text}")
    (out_dir / f"{name}.json").write_text(json.dumps({"network": network._asdict(), "compute_s": compute_s,
                                                           "period": period, "rows": rows,
                                                           "config": config.to_dict()}, indent=1))
    title = f"Delayed Gradient Averaging, {config.network}, {WORKERS} workers"
    plot(rows, out_dir / f"{name}.png", title if period == 1 else f"{title}, averaging every {period} steps")
    print(text, end="")
    shown = sorted({r["delay"] for r in rows} & {10, max(r["delay"] for r in rows)} - {0})
    every = "every step" if period == 1 else f"every {period} steps"
    for latency in (network.latency, config.seed_latency_s):
        net = netmodel.Network(network.bandwidth, latency, network.name)
        for d in shown:
            sync = model_step(audits[d], 0, net, compute_s)
            delayed = model_step(audits[d], d, net, compute_s, period=period)
            print(f"Modeled speedup of D={d} (averaging {every}) over synchronous SGD at {1e3 * latency:.0f} ms "
                  f"one-way latency ({8 * network.bandwidth / 1e6:.0f} Mbit/s, {WORKERS} workers): "
                  f"{sync['paper'] / delayed['paper']:.2f}x if an exchange may take D steps (the paper's system), "
                  f"{sync['in_step'] / delayed['in_step']:.2f}x with compjax's in-step overlap; assumptions: "
                  "python -m experiments.reproduce.dga --help", flush=True)
    return rows


if __name__ == "__main__":
    main()
