"""Data-parallel training of the character transformer on Tiny Shakespeare with any optax transform.

:func:`train` runs M workers (default 4) on the first M devices, in the
worker-stacked layout of :mod:`compjax.parallel`: parameters and optimizer
state carry a leading worker axis sharded ``P("data")``; inside
``jax.shard_map`` every worker takes the gradient of its own loss on its own
windows (local gradients: JAX adds no all-reduce of its own), then calls
``cj.apply_gradients(tx, grads, opt_state, params)`` (``tx.update`` with
params always passed, then ``optax.apply_updates``; DiLoCo's step in place).  Whatever the workers exchange is the transform's
doing: ``make_tx("data")`` may be a compressor chain (synchronous data
parallel, workers stay equal) or a method that lets workers drift apart
between synchronisations (DiLoCo), which is why validation loss is reported
both for worker 0's parameters and for the mean of the workers' parameters,
and, when the state holds a ``cj.DilocoState``, for DiLoCo's global model
(``cj.diloco_global_params``): the model DiLoCo trains, the one to evaluate.

Bytes: each step, ``cj.payload_bytes(opt_state)`` (worker 0's counter: the
bytes this worker put into collectives in that step) is recorded; a transform
without any compressor state (plain ``optax.sgd``) is recorded as 0 bytes with
``payload_counted`` False.

    python -m experiments.lm.train [--steps 300] [--lr 3e-3] [--model tiny] [--out FILE]

runs synchronous data parallel (``cj.identity`` + AdamW) and prints the results.
On CPU, every step is blocked on before the next (see ARCHITECTURE.md).
"""

from __future__ import annotations

from experiments.cpu_devices import force_cpu_devices

if __name__ == "__main__":  # as the main job: 8 simulated CPU devices, the concurrency-optimized scheduler off
    force_cpu_devices(8)

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax as cj
from compjax import parallel
from experiments.lm import data, model

AXIS = "data"
FAST = "fast"  # the fast axis of a 2-D mesh (mesh=)


def _payload(opt_state) -> int | None:
    """Worker 0's ``cj.payload_bytes`` as a Python int; None when the state holds no counter."""
    try:
        return int(np.asarray(cj.payload_bytes(opt_state)).reshape(-1)[0])
    except ValueError:
        return None


def holds_diloco_state(opt_state) -> bool:
    """Whether ``opt_state`` holds a ``cj.DilocoState`` (alone or inside optax combinators)."""
    is_state = lambda x: isinstance(x, cj.DilocoState)
    return any(is_state(x) for x in jax.tree.leaves(opt_state, is_leaf=is_state))


def make_evaluator(loss_fn: Callable) -> Callable:
    """A jitted ``(params, windows (num_batches, B, T + 1)) -> mean loss`` over the batches (``lax.map``).

    Every batch has the same size, so the mean of the batch means is the mean
    over all predicted characters (nats per character).
    """
    @jax.jit
    def evaluate(params, windows):
        return jnp.mean(jax.lax.map(lambda w: loss_fn(params, w), windows))

    return evaluate


def train(
    make_tx: Callable[[str], optax.GradientTransformation],
    *,
    model_config: str | dict = "tiny",
    steps: int,
    workers: int = 4,
    batch_per_worker: int = 16,
    seq_len: int = 64,
    eval_every: int = 100,
    eval_batches: int = 8,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    text: str | None = None,
    mesh: str | None = None,
    fsdp: bool = False,
    precision: str = "fp32",
) -> dict:
    """Train :class:`~experiments.lm.model.CharTransformer` on ``workers`` data-parallel workers.

    Args:
      make_tx: ``axis_name -> transform``, called once with ``"data"``; the
        transform's ``update(grads, state, params)`` gets one worker's local
        gradients and parameters (it is always given ``params``) and its
        updates are added to that worker's parameters.  E.g.
        ``lambda ax: optax.chain(cj.identity(axis_name=ax), optax.adamw(3e-3))``.
      model_config: ``"tiny"``, ``"default"`` or a dict of the model's keyword
        arguments (:func:`experiments.lm.model.config`); its ``seq_len`` (the
        context) must be at least ``seq_len``.
      steps: training steps (>= 1).
      workers: M, the data-parallel workers, on the first M devices.
      batch_per_worker: windows per worker per step (each worker its own).
      seq_len: characters per training input (windows of ``seq_len + 1``).
      eval_every: validation after every ``eval_every`` steps, at step 0
        (before training) and after the last step.
      eval_batches: the validation set: ``eval_batches`` batches of
        ``workers * batch_per_worker`` fixed windows of the validation split
        (:func:`experiments.lm.data.eval_windows`).
      seed: seeds the initialisation (every worker starts from the same
        parameters) and the training windows.
      log: called with a one-line progress message at each validation
        (e.g. ``print``); None: silent.
      text: the corpus (default: :func:`experiments.lm.data.load_text`, which
        checks the sha256); any text works (the vocabulary is built from it).
      mesh: ``"SLOWxFAST"`` (e.g. ``"2x4"``): a 2-D mesh of ``SLOW * FAST``
        devices (``workers`` is then ignored: each device takes
        ``batch_per_worker`` windows), gradients averaged densely over FAST and
        compressed over SLOW; the transform is built with the slow axis.
      fsdp: with ``mesh``, parameters and optimizer state sharded over FAST
        (``parallel.fsdp_specs``): the same numbers, 1/FAST of the state per device.
      precision: ``"fp32"`` or ``"mixed"`` (:data:`experiments.lm.model.PRECISIONS`):
        float32 parameters and optimizer state either way; ``"mixed"`` computes
        in bfloat16 and hands the transform bfloat16 gradients
        (``compjax.parallel.compute_cast``; ``cj.identity`` then sends bfloat16).

    Returns:
      A JSON-serialisable dict:

      - ``config``: the arguments above (``model_config`` resolved to a
        dict), ``num_params``, ``vocab``, ``backend``, ``devices`` (the
        mesh's device ids, worker order).
      - ``train_loss``: list of ``steps`` floats, each step's training loss
        (nats per character) averaged over the workers (each on its own
        windows, before that step's update).
      - ``payload_bytes``: list of ``steps`` ints, the bytes worker 0 put into
        collectives in that step, read from ``cj.payload_bytes(opt_state)``
        (0 for every step if ``payload_counted`` is False).
      - ``payload_counted``: whether the state holds a ``payload_bytes``
        counter (False: no compressor, e.g. plain ``optax.sgd``).
      - ``total_bytes``, ``peak_bytes``: sum and maximum of ``payload_bytes``.
      - ``eval_step``: steps at which validation ran (0 = before training).
      - ``val_loss_worker0``, ``val_loss_mean``: validation cross-entropy in
        nats per character of worker 0's parameters and of the elementwise
        mean of all workers' parameters, at those steps.
      - ``val_loss_global``: when the optimizer state holds a
        ``cj.DilocoState`` (DiLoCo, Streaming DiLoCo), the validation loss of
        the global model, ``cj.diloco_global_params(opt_state, params)`` (the
        outer parameters as of each fragment's last synchronization; at step 0
        the initialization), at those steps; None for other transforms.
      - ``param_spread``: at those steps, the largest
        ``|params[w] - params[0]|`` over workers and entries (0.0 when the
        workers are identical).
      - ``step_seconds``: wall time of each step (the first includes
        compilation), ``compilations``: how many times the step compiled
        (1 if shapes stay static), ``eval_compilations`` likewise for
        validation, ``wall_s``: the whole run.

    Raises:
      ValueError: ``workers`` not in ``[1, len(jax.devices())]``, ``seq_len``
        longer than the model's context, ``steps``, ``eval_every``,
        ``eval_batches`` or ``batch_per_worker`` < 1, ``mesh`` not
        ``SLOWxFAST``, ``fsdp`` without ``mesh``.

    Examples:
      >>> import optax, compjax as cj
      >>> from experiments.lm.train import train
      >>> r = train(lambda ax: optax.chain(cj.identity(axis_name=ax), optax.adamw(3e-3)),
      ...           steps=300, eval_every=100)   # doctest: +SKIP
      >>> r["val_loss_worker0"][-1]   # doctest: +SKIP
    """
    t_start = time.perf_counter()
    for name, value in (("steps", steps), ("eval_every", eval_every), ("eval_batches", eval_batches),
                        ("batch_per_worker", batch_per_worker)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    cfg = model.config(model_config)
    if seq_len > cfg["seq_len"]:
        raise ValueError(f"seq_len={seq_len} is longer than the model's context {cfg['seq_len']}")
    if fsdp and mesh is None:
        raise ValueError("fsdp=True shards over the fast axis of a 2-D mesh: give mesh='SLOWxFAST' too")
    if precision not in model.PRECISIONS:
        raise ValueError(f"precision must be one of {model.PRECISIONS}, got {precision!r}")
    fast_axis, mesh_text = (None, None) if mesh is None else (FAST, mesh)
    if mesh is None:
        mesh = parallel.make_mesh(workers, AXIS)  # the first `workers` devices
    else:
        try:
            slow, fast = (int(v) for v in mesh.lower().split("x"))
        except ValueError:
            raise ValueError(f"mesh must be 'SLOWxFAST' with two integers, e.g. '2x4', got {mesh!r}") from None
        mesh = parallel.make_2d_mesh(slow, fast, slow_axis=AXIS, fast_axis=FAST)
        workers = slow * fast  # one batch per device

    text = data.load_text() if text is None else text
    vocab = data.Vocab.from_text(text)
    train_tokens, val_tokens = data.split(vocab.encode(text))
    val = jnp.asarray(data.eval_windows(val_tokens, eval_batches, workers * batch_per_worker, seq_len))

    params, _, loss_fn = model.build(cfg, vocab.size, seed, precision)
    num_params = sum(int(x.size) for x in jax.tree.leaves(params))
    tx = make_tx(AXIS)
    specs = parallel.fsdp_specs(params, mesh, fast_axis=FAST) if fsdp else None
    p = parallel.replicate(params, mesh, AXIS, fast_axis=fast_axis, specs=specs)
    s = parallel.init_worker_state(tx, params, mesh, AXIS, fast_axis=fast_axis, specs=specs)
    payload_counted = _payload(s) is not None
    diloco = holds_diloco_state(s)
    step = parallel.data_parallel_step(loss_fn, tx, mesh, axis_name=AXIS, fast_axis=fast_axis, specs=specs,
                                       donate=True)
    evaluate = make_evaluator(loss_fn)

    config = {"model_config": cfg, "steps": steps, "workers": workers, "batch_per_worker": batch_per_worker,
              "seq_len": seq_len, "eval_every": eval_every, "eval_batches": eval_batches, "seed": seed,
              "num_params": num_params, "vocab": vocab.size, "backend": jax.default_backend(),
              "devices": [int(d.id) for d in mesh.devices.flat], "mesh": mesh_text, "fsdp": bool(fsdp),
              "precision": precision}
    res = {"config": config, "train_loss": [], "payload_bytes": [], "payload_counted": payload_counted,
           "eval_step": [], "val_loss_worker0": [], "val_loss_mean": [], "val_loss_global": [] if diloco else None,
           "param_spread": [], "step_seconds": []}

    def validate(done: int) -> None:
        host = jax.device_get(p)  # (workers, ...) per leaf
        first = jax.tree.map(lambda x: x[0], host)
        mean = jax.tree.map(lambda x: x.mean(0, dtype=x.dtype), host)
        spread = max(float(np.max(np.abs(x - x[:1]))) for x in jax.tree.leaves(host))
        res["eval_step"].append(done)
        res["val_loss_worker0"].append(float(evaluate(first, val)))
        res["val_loss_mean"].append(float(evaluate(mean, val)))
        res["param_spread"].append(spread)
        if diloco:  # every worker holds the same global model: worker 0's copy
            model_g = jax.device_get(jax.tree.map(lambda x: x[0], cj.diloco_global_params(s, p)))
            res["val_loss_global"].append(float(evaluate(model_g, val)))
        if log is not None:
            train_loss = f"{np.mean(res['train_loss'][-eval_every:]):.4f}" if res["train_loss"] else "n/a"
            glob_txt = f" global {res['val_loss_global'][-1]:.4f}" if diloco else ""
            log(f"step {done}/{steps}: train {train_loss} | val{glob_txt} worker0 {res['val_loss_worker0'][-1]:.4f} "
                f"mean {res['val_loss_mean'][-1]:.4f} | spread {spread:.3g} | "
                f"{res['payload_bytes'][-1] if res['payload_bytes'] else 0:,} B/step/worker")

    validate(0)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        AXIS if fast_axis is None else (AXIS, FAST), None, None))
    for i, batch in enumerate(data.batches(train_tokens, workers, batch_per_worker, seq_len, seed)):
        if i == steps:
            break
        t0 = time.perf_counter()
        p, s, loss = step(p, s, jax.device_put(batch, sharding))
        loss = np.asarray(jax.block_until_ready(loss))  # one collective step in flight at a time (CPU)
        res["step_seconds"].append(time.perf_counter() - t0)
        res["train_loss"].append(float(loss.mean()))
        res["payload_bytes"].append(_payload(s) or 0)
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            validate(i + 1)

    res["total_bytes"] = int(sum(res["payload_bytes"]))
    res["peak_bytes"] = int(max(res["payload_bytes"]))
    res["compilations"] = int(step._cache_size())
    res["eval_compilations"] = int(evaluate._cache_size())
    res["wall_s"] = time.perf_counter() - t_start
    return res


def main(argv=None) -> dict:
    """Synchronous data parallel (``cj.identity`` + AdamW) on the command line; prints and returns the results."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(model.CONFIGS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--mesh", default=None, help="SLOWxFAST (e.g. 2x4): dense over FAST, compressed over SLOW")
    ap.add_argument("--fsdp", action="store_true", help="with --mesh: shard parameters and state over FAST")
    ap.add_argument("--precision", default="fp32", choices=model.PRECISIONS,
                    help="mixed: float32 parameters and state, bfloat16 compute and gradients")
    ap.add_argument("--batch-per-worker", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (constant)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the results dict as JSON")
    ap.add_argument("--data", type=Path, default=None, help="the Tiny Shakespeare text (default: found or downloaded)")
    ap.add_argument("--no-download", action="store_true", help="never download the text")
    args = ap.parse_args(argv)
    try:
        text = data.load_text(args.data, download=not args.no_download)
    except (data.DataUnavailable, data.ChecksumError) as e:
        raise SystemExit(str(e)) from None
    res = train(lambda ax: optax.chain(cj.identity(axis_name=ax), optax.adamw(args.lr)), text=text,
                model_config=args.model, steps=args.steps, workers=args.workers,
                batch_per_worker=args.batch_per_worker, seq_len=args.seq_len, eval_every=args.eval_every,
                eval_batches=args.eval_batches, seed=args.seed, log=lambda m: print(m, flush=True),
                mesh=args.mesh, fsdp=args.fsdp, precision=args.precision)
    after = res["step_seconds"][1:] or res["step_seconds"]
    print(f"{res['config']['num_params']:,} params | first step {res['step_seconds'][0]:.2f} s | "
          f"median step {np.median(after) * 1e3:.1f} ms | wall {res['wall_s']:.1f} s | "
          f"compilations {res['compilations']}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
