"""Federated learning with compressed uplinks (Huang, Li & Li, ICLR 2024) in shape: accuracy vs uplink bytes.

    python -m experiments.reproduce.federated                  # the full setup below, every row, both seeds
    python -m experiments.reproduce.federated --config.rounds=20 --config.seeds=0 --rows fedavg,scafcom-top1%
    python -m experiments.reproduce.federated --publish   # the committed results

The settings are ml_collections config ``experiments/configs/federated_fashion_mnist.py``
(``--config FILE`` names another; ``--config.KEY=VALUE`` overrides a key).
Fashion-MNIST split over ``N = 200`` clients holding **2 classes each**
(:func:`compjax.federated.classes_per_client_split`, seeded; the label
histogram is saved in the JSON), ``10%`` participation (``S = 20`` clients
sampled per round with a key), ``K = 10`` local SGD steps of batch 32 per
round, multinomial logistic regression (784 x 10 + 10 = 7,850 parameters;
``--config.hidden=64`` gives a 784-64-10 MLP), equal client weights.  Rows
(the config's ``rows``): FedAvg and classic SCAFFOLD (two float32 messages)
and its single-message form (one) in full precision; compressed FedAvg with
top-1% (no error feedback); SCALLION with unbiased random-k; SCAFCOM with
top-1% (no error feedback).  ``α`` and ``β``: SCALLION diverged with
``α >= 0.3`` at random-5% (``ω = 19``; the analysis asks for ``α`` about
``1/(1+ω)``), so ``α = 0.1``; ``β = 0.2`` as in the paper's notes.  Every row
runs with the config's seeds (the seed fixes the model initialisation, the
client sampling, the minibatches and the compressors' keys; the split is the
same for all).

Uplink bytes are what the compressor's collective over the client axis
carried (``cj.payload_bytes`` of the uplink state, summed over the ``S``
participants, every round); downlink bytes (the server's ``x``, and ``c``
for the SCAFFOLD family, to each participant) come from the shapes.  The
claim checked: SCALLION and SCAFCOM reach the accuracy of full-precision
SCAFFOLD with >= 20x fewer uplink bytes, and compressed FedAvg falls behind.
"Bytes to target" is the cumulative uplink when a row's test accuracy (mean
over seeds, evaluated every ``eval_every`` rounds) first reaches the
target: ``target_fraction`` of classic SCAFFOLD's final accuracy.

Outputs in ``<out>``: ``federated_fashion_mnist.json`` (the command, the full
config, provenance, split histogram, every curve), ``.md`` (the table) and
``.png`` (test accuracy vs cumulative uplink bytes), where ``<out>`` is
``runs/reproduce`` (git-ignored), with ``--publish``
``experiments/results/reproduce`` (the committed results), or ``--out-dir``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from experiments import config_cli, records
from experiments.reproduce import common

NAME = "federated_fashion_mnist"
PROG = "python -m experiments.reproduce.federated"
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / f"{NAME}.py"
AXIS = "clients"
ALGORITHMS = ("fedavg", "scaffold", "scallion", "scafcom")
UPLINKS = ("topk", "randomk", "qsgd")


def rows_of(config) -> dict[str, tuple[str, dict]]:
    """The config's rows as ``name -> (algorithm, options)`` (options: every key but ``name`` and ``algorithm``)."""
    return {r["name"]: (r["algorithm"], {k: v for k, v in r.items() if k not in ("name", "algorithm")})
            for r in config.rows}


def check(config) -> None:
    """What can be checked before the data loads; one-line ``SystemExit`` naming the key."""
    def fail(key, what):
        value = "..." if key == "rows" else repr(config_cli.get(config, key))
        raise SystemExit(f"{PROG}: --config.{key}={value}: {what}")

    for key in ("num_clients", "local_steps", "batch_size", "rounds", "eval_every"):
        if config[key] < 1:
            fail(key, "must be >= 1")
    if config.hidden < 0:
        fail("hidden", "must be >= 0 (0: logistic regression)")
    if not 0 < config.participation <= 1:
        fail("participation", "must be in (0, 1]")
    if not config.seeds or not all(isinstance(x, int) and not isinstance(x, bool) for x in config.seeds):
        fail("seeds", "needs one or more integer seeds, e.g. --config.seeds=0,1")
    if config.split not in ("classes", "dirichlet"):
        fail("split", "must be 'classes' or 'dirichlet'")
    if config.train_limit is not None and config.train_limit < 1:
        fail("train_limit", "must be >= 1 (or None: every training image)")
    for r in config.rows:
        if not isinstance(r, dict) or "name" not in r:
            fail("rows", "each row is a dict with a name, an algorithm and an uplink")
        if r.get("algorithm") not in ALGORITHMS:
            fail("rows", f"row {r.get('name')!r}: algorithm must be one of {', '.join(ALGORITHMS)}")
        up = r.get("uplink")
        if up is not None and (len(up) != 2 or up[0] not in UPLINKS):
            fail("rows", f"row {r.get('name')!r}: uplink must be None or (kind, arg), kind one of {', '.join(UPLINKS)}")


def build_uplink(spec, seed: int):
    """The compressor of a row's uplink over the client axis (no error feedback, no non-finite vote)."""
    import compjax as cj

    if spec is None:
        return None
    kind, arg = spec
    if kind == "topk":
        return cj.topk(arg, error_feedback=False, skip_nonfinite=False, axis_name=AXIS)
    if kind == "randomk":
        return cj.randomk(arg, key=seed, error_feedback=False, skip_nonfinite=False, axis_name=AXIS)
    if kind == "qsgd":
        return cj.qsgd(arg, key=seed, skip_nonfinite=False, axis_name=AXIS)
    raise ValueError(f"unknown uplink {spec!r}")


def build_algorithm(row: str, loss_fn, settings, seed: int):
    """The :class:`compjax.federated.FederatedAlgorithm` of ``row`` (a name in ``settings.rows``)."""
    import compjax as cj

    name, opts = rows_of(settings)[row]
    common = {"num_clients": settings["num_clients"], "participation": settings["participation"],
                  "local_steps": settings["local_steps"], "local_lr": settings["local_lr"],
                  "global_lr": settings["global_lr"], "client_axis": AXIS}
    comp = build_uplink(opts.get("uplink"), seed)
    if name == "fedavg":
        return cj.federated.fedavg(loss_fn, compressor=comp, **common)
    if name == "scaffold":
        return cj.federated.scaffold(loss_fn, single_message=opts.get("single_message", False), **common)
    if name == "scallion":
        return cj.federated.scallion(loss_fn, alpha=opts["alpha"], compressor=comp, **common)
    if name == "scafcom":
        return cj.federated.scafcom(loss_fn, beta=opts["beta"], compressor=comp, **common)
    raise ValueError(f"unknown algorithm {name!r}")


def mlp_init(key, hidden: int):
    """A 784-``hidden``-10 MLP (LeCun-normal weights, zero biases) as a dict of float32 arrays."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(key)
    if hidden == 0:  # logistic regression
        return {"w2": jnp.zeros((784, 10)), "b2": jnp.zeros(10)}
    return {"w1": jax.random.normal(k1, (784, hidden)) * (1 / 28.0), "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, 10)) * (1 / hidden ** 0.5), "b2": jnp.zeros(10)}


def mlp_logits(p, x):
    import jax

    h = jax.nn.relu(x @ p["w1"] + p["b1"]) if "w1" in p else x
    return h @ p["w2"] + p["b2"]


def loss_fn(p, batch):
    """Mean softmax cross-entropy of one minibatch ``(x (B, 784), y (B,))``."""
    import optax

    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(p, x), y).mean()


def load_data(settings):
    """Normalised, flattened Fashion-MNIST, the split, its histogram, and the padded client arrays."""
    import numpy as np

    import compjax as cj
    from experiments.data import load_fashion_mnist

    xtr, ytr, xte, yte = load_fashion_mnist()
    if settings["train_limit"]:
        xtr, ytr = xtr[: settings["train_limit"]], ytr[: settings["train_limit"]]
    mean, std = 0.2860, 0.3530
    xtr = ((xtr.reshape(len(xtr), -1) - mean) / std).astype(np.float32)
    xte = ((xte.reshape(len(xte), -1) - mean) / std).astype(np.float32)
    if settings["split"] == "classes":
        parts = cj.federated.classes_per_client_split(ytr, settings["num_clients"], settings["classes_per_client"],
                                                      seed=settings["split_seed"])
    else:
        parts = cj.federated.dirichlet_split(ytr, settings["num_clients"], settings["dirichlet_alpha"],
                                             seed=settings["split_seed"])
    hist = cj.federated.label_histogram(ytr, parts, 10)
    padded, counts = cj.federated.pad_clients((xtr, ytr), parts)
    return padded, counts, hist, (xte, yte)


def run_row(row: str, seed: int, settings, data) -> dict:
    """One run: every round one jitted call (sample clients, draw their batches, the round); evaluated every few rounds."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import compjax as cj

    padded, counts, _, (xte, yte) = data
    alg = build_algorithm(row, loss_fn, settings, seed)
    K, B = settings["local_steps"], settings["batch_size"]
    params = mlp_init(jax.random.PRNGKey(1000 + seed), settings["hidden"])
    state = alg.init(params)
    px, py, cnt = jnp.asarray(padded[0]), jnp.asarray(padded[1]), jnp.asarray(counts)
    xt, yt = jnp.asarray(xte), jnp.asarray(yte)

    @jax.jit
    def step(state, key, px, py, cnt):
        k_clients, k_batches = jax.random.split(key)
        clients = alg.sample_clients(k_clients)
        batches = cj.federated.sample_batches(k_batches, (px, py), cnt, clients, K, B)
        return alg.round(state, clients, batches)

    @jax.jit
    def accuracy(p):
        return jnp.mean(jnp.argmax(mlp_logits(p, xt), -1) == yt)

    key = jax.random.PRNGKey(seed)
    down = alg.downlink_bytes(params) * alg.clients_per_round
    up_total, curve, losses = 0, [], []
    t0 = time.time()
    for r in range(1, settings["rounds"] + 1):
        state, info = step(state, jax.random.fold_in(key, r), px, py, cnt)
        up_total += int(cj.payload_bytes(state).sum())  # blocks on the round
        losses.append(float(jnp.mean(info.loss)))
        if r % settings["eval_every"] == 0 or r == settings["rounds"]:
            curve.append({"round": r, "uplink_bytes": up_total, "downlink_bytes": down * r,
                          "test_accuracy": float(accuracy(state.server.params)), "train_loss": losses[-1]})
    wall = time.time() - t0
    num_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    print(f"{row:>16} seed {seed}: test accuracy {curve[-1]['test_accuracy']:.4f}, uplink "
          f"{up_total / 1e6:.1f} MB, {wall:.0f} s", flush=True)
    algorithm, options = rows_of(settings)[row]
    return {"row": row, "seed": seed, "algorithm": algorithm, "options": options, "curve": curve,
            "uplink_bytes_per_round": up_total // settings["rounds"], "downlink_bytes_per_round": down,
            "num_params": num_params, "wall_s": wall}


def summarize(runs: list[dict], settings) -> list[dict]:
    """Per row: accuracy (mean over seeds) at the end, bytes, and the uplink bytes to reach the target accuracy."""
    import numpy as np

    rows: dict[str, list[dict]] = {}
    for r in runs:
        rows.setdefault(r["row"], []).append(r)
    mean_curve = {k: np.mean([[p["test_accuracy"] for p in r["curve"]] for r in v], axis=0) for k, v in rows.items()}
    ref = "scaffold" if "scaffold" in rows else next(iter(rows))
    target = settings["target_fraction"] * float(mean_curve[ref][-1])
    out = []
    for k, v in rows.items():
        curve, acc = v[0]["curve"], mean_curve[k]
        hit = next((i for i, a in enumerate(acc) if a >= target), None)
        out.append({
            "row": k, "algorithm": v[0]["algorithm"], "uplink": v[0]["options"].get("uplink"),
            "accuracy": float(acc[-1]), "accuracy_per_seed": [r["curve"][-1]["test_accuracy"] for r in v],
            "seeds": [r["seed"] for r in v], "uplink_bytes_per_round": v[0]["uplink_bytes_per_round"],
            "uplink_bytes_total": curve[-1]["uplink_bytes"], "downlink_bytes_total": curve[-1]["downlink_bytes"],
            "round_to_target": None if hit is None else curve[hit]["round"],
            "uplink_to_target": None if hit is None else curve[hit]["uplink_bytes"],
            "wall_s": float(np.mean([r["wall_s"] for r in v])),
        })
    base = next((o for o in out if o["row"] == ref), None)
    for o in out:
        o["uplink_ratio_per_round"] = base["uplink_bytes_per_round"] / o["uplink_bytes_per_round"]
        ok = base["uplink_to_target"] and o["uplink_to_target"]
        o["uplink_ratio_to_target"] = base["uplink_to_target"] / o["uplink_to_target"] if ok else None
    return out, target, ref


def table(summary: list[dict], target: float, ref: str, settings) -> str:
    s = settings
    model = f"MLP 784-{s['hidden']}-10" if s["hidden"] else "logistic regression"
    lines = [
        (f"Fashion-MNIST, {model}, {s['num_clients']} clients with {s['classes_per_client']} classes each, "
        f"{int(100 * s['participation'])}% participation, {s['local_steps']} local steps of batch {s['batch_size']}, "
        f"η_l = {s['local_lr']}, η_g = {s['global_lr']}, {s['rounds']} rounds, seeds {list(s['seeds'])} (accuracy: mean "
        f"over seeds). Target: {100 * s['target_fraction']:.0f}% of {ref}'s final accuracy = {100 * target:.2f}%."),
        "",
        ("| row | uplink | test accuracy | per seed | uplink bytes/round (all clients) | uplink ÷ vs "
        f"{ref} per round | rounds to target | uplink bytes to target | uplink ÷ vs {ref} to target | "
        "downlink bytes (run) | wall s/run |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in summary:
        up = "float32" if o["uplink"] is None else f"{o['uplink'][0]} {o['uplink'][1]}"
        seeds = ", ".join(f"{100 * a:.2f}" for a in o["accuracy_per_seed"])
        hit = "not reached" if o["round_to_target"] is None else str(o["round_to_target"])
        to_t = "—" if o["uplink_to_target"] is None else f"{o['uplink_to_target']:,}"
        ratio_t = "—" if o["uplink_ratio_to_target"] is None else f"{o['uplink_ratio_to_target']:.1f}×"
        lines.append(f"| {o['row']} | {up} | {100 * o['accuracy']:.2f}% | {seeds} | {o['uplink_bytes_per_round']:,} | "
                     f"{o['uplink_ratio_per_round']:.1f}× | {hit} | {to_t} | {ratio_t} | "
                     f"{o['downlink_bytes_total']:,} | {o['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Test accuracy (mean over seeds) against cumulative uplink bytes, one line per row, log x."""
    import numpy as np

    rows: dict[str, list[dict]] = {}
    for r in runs:
        rows.setdefault(r["row"], []).append(r)
    with common.figure(path, figsize=(7, 4.5)) as (_, ax):
        for k, v in rows.items():
            xs = [p["uplink_bytes"] for p in v[0]["curve"]]
            ys = 100 * np.mean([[p["test_accuracy"] for p in r["curve"]] for r in v], axis=0)
            ax.plot(xs, ys, label=k, marker="." if "%" in k else None)
        common.finish_axes(ax, "cumulative uplink bytes (all participating clients)", "test accuracy (%)", title,
                           log_x=True, title_size=9, legend_size=8)


def main(argv=None) -> list[dict]:
    p = common.parser(PROG, __doc__, DEFAULT_CONFIG, "--config.rounds=20 --config.seeds=0")
    p.add_argument("--rows", default="", help="comma-separated names of the config's rows to run (default: all)")
    head = common.parse(p, argv, DEFAULT_CONFIG)
    config, args, out_dir, command = head.config, head.args, head.out_dir, head.command
    check(config)
    all_rows = rows_of(config)
    rows = args.rows.split(",") if args.rows else list(all_rows)
    unknown = [r for r in rows if r not in all_rows]
    if unknown:
        raise SystemExit(f"{PROG}: --rows: unknown rows {unknown}; the config's rows: {', '.join(all_rows)}")
    t0 = time.time()
    provenance = records.provenance(command)
    data = load_data(config)
    runs = [run_row(r, s, config, data) for r in rows for s in config.seeds]
    summary, target, ref = summarize(runs, config)
    text = table(summary, target, ref, config)
    wall = time.time() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    hist = data[2]
    (out_dir / f"{NAME}.json").write_text(json.dumps({
        "command": command, "config": config.to_dict(), "provenance": provenance,
        "rows": {k: all_rows[k] for k in rows}, "split": {"kind": config.split, "seed": config.split_seed,
                                                          "label_histogram": hist.tolist()},
        "summary": summary, "target_accuracy": target, "runs": runs, "wall_s": wall}, indent=1))
    (out_dir / f"{NAME}.md").write_text(f"<!-- generated by: {command} (wall time {wall:.0f} s) -->\n{text}")
    plot(runs, out_dir / f"{NAME}.png",
         f"Fashion-MNIST, {config.num_clients} clients × {config.classes_per_client} classes, "
         f"{int(100 * config.participation)}% participation, K = {config.local_steps}")
    print(text, end="")
    print(f"wall time {wall:.0f} s; wrote {out_dir / NAME}.{{json,md,png}}", flush=True)
    return summary


if __name__ == "__main__":
    main()
