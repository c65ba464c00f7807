"""The main job's training loop, from a checked config (:mod:`experiments.train` parses and checks it).

Builds the model, the optax chain (compressor, SGD with warm-up and cosine
decay, the non-finite guard), the mesh and the data-parallel step, then trains
epoch by epoch, writing one JSONL record per epoch and a summary when the run
finishes; checkpoints, resuming and multi-process runs as described in
:mod:`experiments.train`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

import jax
import ml_collections
import numpy as np
import optax
from tqdm import tqdm

import compjax as cj
from compjax import bytecount, parallel
from compjax.checkpoint import Checkpointer
from experiments import cifar10, compressors, data, distributed, models, records
from experiments.checks import check_step_flags, count_steps, parse_mesh

AXIS = "data"  # the compressed axis (the slow axis of a 2-D mesh)
FAST = "fast"  # the fast axis of a 2-D mesh (--mesh), averaged densely
#: dataset name -> loader ``(root, download=) -> (x_train, y_train, x_test, y_test)``.
DATASETS = {"fashion_mnist": data.load_fashion_mnist, "cifar10": cifar10.load_cifar10}


def lr_schedule(config, steps_total: int) -> optax.Schedule:
    """Linear warm-up from 0 to ``lr`` over ``warmup_steps``, then cosine decay to 0 at the last step."""
    return optax.warmup_cosine_decay_schedule(
        0.0, config.lr, min(config.warmup_steps, max(1, steps_total - 1)), max(steps_total, 2)
    )


def momentum_after(config) -> float | None:
    """The momentum of the optimizer after the compressor: none when the compressor carries it (DGC)."""
    return None if compressors.momentum_inside(config.compressor.name) else config.momentum


def optimizer(config, steps_total: int) -> optax.GradientTransformation:
    """SGD with :func:`lr_schedule` and :func:`momentum_after` (and L2 weight decay if ``weight_decay``)."""
    sgd = optax.sgd(lr_schedule(config, steps_total), momentum=momentum_after(config))
    return optax.chain(optax.add_decayed_weights(config.weight_decay), sgd) if config.weight_decay else sgd


def transform(config, compressor: optax.GradientTransformation, steps_total: int) -> optax.GradientTransformation:
    """The whole optax chain of a worker: local gradients in, parameter updates out.

    Default: ``chain(compressor, [weight decay], sgd(schedule, momentum))``.  With
    ``lr_before_compressor`` the learning rate scales each worker's gradient
    *before* the compressor, so error-feedback residuals and DGC's accumulation
    hold ``lr``-weighted gradients (Lin et al. 2018, Algorithm 1; Aji & Heafield
    2017): an entry sent late is applied with the learning rate of the steps that
    produced it, not with the (decayed) rate of the step that sends it.  Then
    ``chain([weight decay], scale_by_learning_rate, compressor, [trace(momentum)])``.
    """
    if not config.lr_before_compressor:
        return optax.chain(compressor, optimizer(config, steps_total))
    momentum = momentum_after(config)
    decay = [optax.add_decayed_weights(config.weight_decay)] if config.weight_decay else []
    after = [optax.trace(decay=momentum)] if momentum else []
    return optax.chain(*decay, optax.scale_by_learning_rate(lr_schedule(config, steps_total)), compressor, *after)


def guard(config, tx: optax.GradientTransformation, axis_name: str | None) -> optax.GradientTransformation:
    """``tx`` wrapped in ``cj.apply_if_finite`` over ``axis_name`` (unless ``skip_nonfinite`` is off).

    When any worker's gradient holds a NaN or an infinity, every worker skips
    the whole step: no update, compressor state, momentum and the schedule's
    count untouched (the compressor's own guard would only zero its output,
    and the momentum after it would still move the parameters).
    """
    return cj.apply_if_finite(tx, axis_name=axis_name) if config.skip_nonfinite else tx


def build_compressor(config, axis_name: str | None):
    """``(compressor, options recorded)`` of ``config.compressor``; the compressor's own vote off (see guard)."""
    return compressors.build(config.compressor, axis_name, momentum=config.momentum, skip_nonfinite=False)


def poison(x: np.ndarray, worker: int, workers: int) -> np.ndarray:
    """A copy of the global batch ``x`` with the first value of ``worker``'s shard set to NaN."""
    x = np.array(x, copy=True)
    x.reshape(workers, -1)[worker, 0] = np.nan  # worker W holds rows [W*b, (W+1)*b)
    return x


def digest(tree) -> str:
    """SHA-256 of a pytree's leaves (dtype, shape and bytes, in tree order): equal iff bitwise equal."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def setup_processes(opts) -> bool:
    """Join a multi-process run when asked (flags, environment or --distributed); True if there are several."""
    address, count, pid = distributed.settings(opts.coordinator_address, opts.num_processes, opts.process_id)
    if opts.distributed or (count or 1) > 1:
        try:
            distributed.initialize(address, count, pid, heartbeat_timeout=opts.heartbeat_timeout)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    return jax.process_count() > 1


def build_mesh(config):
    """``(mesh, fast_axis, workers)`` from the config's ``mesh`` / ``workers``."""
    shape = parse_mesh(config.mesh)
    if shape is None:
        try:
            mesh = parallel.make_mesh(config.workers, AXIS)
        except ValueError as e:
            raise SystemExit(f"--workers {config.workers}: {e}") from None
        return mesh, None, mesh.shape[AXIS]
    try:
        mesh = parallel.make_2d_mesh(*shape, slow_axis=AXIS, fast_axis=FAST)
    except ValueError as e:
        raise SystemExit(f"--mesh {config.mesh}: {e}") from None
    return mesh, FAST, shape[0] * shape[1]


def load_data(config, opts):
    """The dataset's arrays; a one-line ``SystemExit`` when it is nowhere and cannot be downloaded."""
    try:
        return DATASETS[config.dataset](opts.data_dir, download=not opts.no_download)
    except (data.DataUnavailable, data.ChecksumError) as e:
        raise SystemExit(str(e)) from None


def run(config: ml_collections.ConfigDict, opts: argparse.Namespace, *, command: str = "") -> dict:
    """Train as ``config`` says; return the summary record (also written to the run's JSONL file)."""
    multi = setup_processes(opts)
    lead = jax.process_index() == 0  # the process that writes records and prints the epoch lines
    t_start = time.time()
    mesh, fast_axis, n = build_mesh(config)
    if config.batch_size % n:
        raise SystemExit(f"--batch-size {config.batch_size}: must be divisible by the {n} workers")
    check_step_flags(config, n)  # before loading the data: what is known without it
    x_train, y_train, x_test, y_test = load_data(config, opts)
    if config.train_limit:
        x_train, y_train = x_train[: config.train_limit], y_train[: config.train_limit]

    steps_per_epoch = len(x_train) // config.batch_size
    steps_total = count_steps(config, len(x_train))  # batches taken; skip_batch runs one step fewer
    check_step_flags(config, n, steps_total)
    poison_worker = config.poison_worker or 0

    params, apply, loss_fn = models.build(config.seed, model=config.model)
    num_params = sum(int(x.size) for x in jax.tree.leaves(params))
    dense_bytes = 4 * num_params  # identity's float32 all-reduce payload
    # Under the wrapper the chain never sees a non-finite gradient: the compressor's own vote (one more
    # collective per step) would be redundant, so it is off either way.
    compressor, comp_opts = build_compressor(config, AXIS)
    tx = guard(config, transform(config, compressor, steps_total), AXIS)

    # --fsdp: every leaf large enough sharded over the fast axis (numbers as without; 1/FAST of the state each).
    specs = parallel.fsdp_specs(params, mesh, fast_axis=FAST) if config.get("fsdp") else None
    p = parallel.replicate(params, mesh, AXIS, fast_axis=fast_axis, specs=specs)
    s = parallel.init_worker_state(tx, params, mesh, AXIS, fast_axis=fast_axis, specs=specs)
    step = parallel.data_parallel_step(loss_fn, tx, mesh, axis_name=AXIS, fast_axis=fast_axis, specs=specs,
                                       donate=True)

    name = config.compressor.name
    record_config = {
        "compressor": name, "options": comp_opts, "dataset": config.dataset, "model": config.model,
        "epochs": config.epochs, "max_steps": config.max_steps, "weight_decay": config.weight_decay,
        "augment": config.augment, "batch_size": config.batch_size, "lr": config.lr, "momentum": config.momentum,
        "lr_before_compressor": config.lr_before_compressor, "warmup_steps": config.warmup_steps,
        "seed": config.seed, "workers": n, "skip_nonfinite": config.skip_nonfinite,
        "poison_step": config.poison_step,
        "poison_worker": poison_worker if config.poison_step is not None else None,
        "skip_batch": config.skip_batch, "train_images": len(x_train), "num_params": num_params,
        "steps_per_epoch": steps_per_epoch, "steps": steps_total, "backend": jax.default_backend()}
    if config.mesh or multi:
        record_config.update(mesh=dict(mesh.shape), processes=jax.process_count(), fsdp=bool(config.get("fsdp")))

    prov = records.provenance(command) if lead else None
    rng = np.random.default_rng(config.seed)
    # done: steps taken so far (one per batch, a dropped one included), i.e. the 0-based index of the next
    # step, the count poison_step and skip_batch name; run: steps run; skipped: steps the guard skipped.
    prog = {"epoch": 0, "i": 0, "done": 0, "run": 0, "skipped": [], "bytes_per_step": 0, "bytes_total": 0,
            "losses": [], "skipped_epoch": [], "records": [], "wall_s": 0.0, "out": None}
    perm = np.zeros(len(x_train), np.int64)  # this epoch's order (drawn at the start of each epoch)
    ckpt = Checkpointer(opts.checkpoint_dir) if opts.checkpoint_dir else None
    if ckpt is not None and ckpt.latest_step() is not None:
        p, s, perm, prog, rng = resume(ckpt, record_config, p, s, perm, rng)
        t_start -= prog["wall_s"]

    # The records' file: --out, else the one the resumed run wrote, else a new one under runs/train/.
    out = Path(opts.out or prog.get("out") or records.run_path("train", name, config.to_dict()))
    prog["out"] = str(out)
    if lead:
        out.parent.mkdir(parents=True, exist_ok=True)
    where = f"{n} workers" + (f" on a {config.mesh} mesh" if config.mesh else "")
    where += f" in {jax.process_count()} processes" if multi else ""
    print(f"compjax main job: {name} {comp_opts} | {where} on {jax.default_backend()} | "
          f"{num_params:,} params | {steps_total} steps"
          + (f" | resumed at step {prog['done']}" if prog["done"] else ""), flush=True)
    resume_hint = (f"Restart every process with --checkpoint-dir {opts.checkpoint_dir} to resume from the last "
                   "checkpoint." if ckpt else "")
    if multi:
        distributed.watch(resume_hint)

    def save():
        prog["wall_s"] = time.time() - t_start
        extra = {"config": record_config, "progress": prog, "rng": rng.bit_generator.state}
        if ckpt.latest_step() != prog["done"]:
            ckpt.save(prog["done"], {"params": p, "opt_state": s, "perm": perm}, extra=extra)
            tqdm.write(f"checkpoint: saving step {prog['done']} in {ckpt.directory} (in the background)")

    stop = steps_total if opts.stop_after is None else min(steps_total, opts.stop_after)
    start = prog["done"]
    try:
        with ExitStack() as stack:
            f = stack.enter_context(open(out if lead else os.devnull, "a" if start else "w"))
            bar = stack.enter_context(tqdm(total=steps_total, initial=start, unit="step",
                                           disable=opts.no_progress or not lead))
            if ckpt:
                stack.callback(ckpt.close)  # waits for the last save
            while prog["epoch"] < config.epochs and prog["done"] < stop:
                if prog["i"] == 0:
                    perm = rng.permutation(len(x_train))
                while prog["i"] < steps_per_epoch and prog["done"] < stop:
                    i, done = prog["i"], prog["done"]
                    idx = perm[i * config.batch_size:(i + 1) * config.batch_size]
                    x = cifar10.random_crop_flip(x_train[idx], rng) if config.augment else x_train[idx]
                    prog["i"] += 1
                    prog["done"] += 1
                    bar.update(1)
                    if done == config.skip_batch:  # after the augmentation: later batches draw the same randomness
                        tqdm.write(f"step {done}: batch dropped (--skip-batch)")
                    else:
                        if done == config.poison_step:
                            x = poison(x, poison_worker, n)
                        batch = parallel.shard_batch((x, y_train[idx]), mesh, AXIS, fast_axis=fast_axis)
                        p, s, loss = step(p, s, batch)
                        loss = parallel.gather(jax.block_until_ready(loss))  # one collective step in flight
                        record_step(prog, s, loss, done, n, bar)
                    epoch_ends = prog["i"] == steps_per_epoch or prog["done"] == steps_total
                    if ckpt and not epoch_ends and (prog["done"] == stop or (
                            opts.checkpoint_every and prog["done"] % opts.checkpoint_every == 0)):
                        save()
                if prog["i"] == steps_per_epoch or prog["done"] == steps_total:
                    end_epoch(prog, apply, p, x_test, y_test, dense_bytes, t_start, f)
                    if ckpt:
                        save()
            summary = make_summary(prog, record_config, p, dense_bytes, t_start, steps_per_epoch)
            finished = prog["done"] == steps_total
            if finished and prog["done"] > start and lead:
                summary["full_config"] = config.to_dict()
                summary["provenance"] = prov
                f.write(json.dumps(summary) + "\n")
    except Exception as e:
        if multi:  # a collective or the checkpoint barrier failed: most likely a process was lost
            distributed.exit_lost_peer(str(e), resume_hint)
        raise
    if multi:
        distributed.finish()
    ratio = f"{summary['compression_ratio']:.1f}x" if summary["compression_ratio"] else "n/a"
    acc = summary["test_accuracy"]
    print(f"{'SUMMARY' if finished else 'STOPPED'} compressor={name} options={json.dumps(comp_opts)} "
          f"step={prog['done']}/{steps_total} "
          f"test_accuracy={'n/a' if acc is None else f'{acc:.4f}'} "
          f"mean_bytes/step/worker={summary['payload_bytes_mean_per_step']:,.0f} ratio={ratio} "
          f"(last step {prog['bytes_per_step']:,} B) skipped_steps={prog['skipped']} "
          f"wall={summary['wall_s']:.0f}s record={out if lead else '(process 0)'}", flush=True)
    return summary


def resume(ckpt: Checkpointer, config: dict, p, s, perm, rng):
    """Restore ``(params, opt_state, perm, progress, rng)`` from ``ckpt``'s latest step; exit if the run differs."""
    try:
        state, extra = ckpt.restore({"params": p, "opt_state": s, "perm": perm})
    except ValueError as e:
        raise SystemExit(f"cannot resume: {e}") from None
    saved, config = extra["config"], json.loads(json.dumps(config))  # compare as saved: tuples are lists
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {config.get(k)!r}" for k in sorted({*saved, *config})
            if saved.get(k) != config.get(k)]
    if diff:
        raise SystemExit(f"cannot resume from {ckpt.directory}: the run differs from the checkpoint's ("
                         + "; ".join(diff) + ")")
    rng.bit_generator.state = extra["rng"]
    return state["params"], state["opt_state"], np.asarray(state["perm"]), extra["progress"], rng


def record_step(prog: dict, s, loss: np.ndarray, done: int, n: int, bar) -> None:
    """Count a step that ran: bytes, loss, or a step the guard skipped."""
    prog["run"] += 1
    local = parallel.local_view(s)  # counters and flags: this process's first worker (all agree)
    if isinstance(s, cj.ApplyIfFiniteState) and not bool(np.asarray(local.last_finite)[0]):
        # Only the wrapper's vote went over the wire (the chain inside it did not run).
        prog["bytes_total"] += int(bytecount.to_int(np.asarray(local.payload_bytes))[0])
        bad = ", ".join(str(w) for w in np.flatnonzero(~np.isfinite(loss)))
        who = f" (non-finite loss on worker {bad})" if bad else ""
        tqdm.write(f"step {done}: non-finite gradient on a worker{who}; all {n} workers skipped it")
        prog["skipped_epoch"].append(done)
    else:
        prog["bytes_per_step"] = int(np.asarray(cj.payload_bytes(local))[0])
        prog["bytes_total"] += prog["bytes_per_step"]
        prog["losses"].append(float(np.mean(loss)))
        bar.set_postfix(loss=f"{prog['losses'][-1]:.3f}")


def end_epoch(prog: dict, apply, p, x_test, y_test, dense_bytes: int, t_start: float, f) -> None:
    """Evaluate, write the epoch's record and start the next epoch's counters."""
    prog["skipped"] += prog["skipped_epoch"]
    model, worker0 = evaluated_params(p)
    acc = models.accuracy(apply, model, x_test, y_test)
    bps = prog["bytes_per_step"]
    rec = {"kind": "epoch", "epoch": prog["epoch"] + 1, "step": prog["done"],
           "train_loss": float(np.mean(prog["losses"])) if prog["losses"] else None,  # over the steps applied
           "test_accuracy": acc, "payload_bytes_per_step": bps,
           "compression_ratio": dense_bytes / bps if bps else None,
           "skipped_steps": prog["skipped_epoch"], "wall_s": time.time() - t_start}
    if worker0 is not None:  # the workers' models differ (delayed averaging): worker 0's own model too
        rec["evaluated"] = "workers' average"
        rec["test_accuracy_worker0"] = models.accuracy(apply, worker0, x_test, y_test)
    prog["records"].append(rec)
    f.write(json.dumps(rec) + "\n")
    f.flush()
    ratio = f"{rec['compression_ratio']:.1f}x" if rec["compression_ratio"] else "n/a"
    loss_txt = "n/a" if rec["train_loss"] is None else f"{rec['train_loss']:.4f}"
    own = f" (workers' average; worker 0: {rec['test_accuracy_worker0']:.4f})" if "evaluated" in rec else ""
    tqdm.write(f"epoch {prog['epoch'] + 1}: test accuracy {acc:.4f}{own} | train loss {loss_txt} | "
               f"payload {bps:,} B/step/worker (last step) | ratio vs identity {ratio}")
    prog.update(epoch=prog["epoch"] + 1, i=0, losses=[], skipped_epoch=[])


def evaluated_params(p):
    """``(model, worker0)``: the parameters to evaluate and, when the workers' parameters differ, worker 0's.

    Synchronous methods keep every worker's parameters equal: the model is worker
    0's and ``worker0`` is None.  Under delayed gradient averaging each worker
    has also applied its own last ``D`` local gradients, not yet replaced by
    their averages; the model evaluated is then the workers' average (the mean
    of the workers' updates is the synchronous update ``mean_j g^j_t`` at every
    step, so the average follows the data-parallel trajectory, with gradients
    taken at the workers' own parameters), and worker 0's model is returned
    beside it.  With several processes every process must call this (it
    gathers the parameters).
    """
    host = parallel.gather(p)
    if all(bool((x == x[:1]).all()) for x in jax.tree.leaves(host)):
        return parallel.unreplicate(p), None
    first = jax.tree.map(lambda x: x[0], host)
    return jax.tree.map(lambda x: x.mean(axis=0, dtype=np.float64).astype(x.dtype), host), first


def make_summary(prog: dict, config: dict, p, dense_bytes: int, t_start: float, steps_per_epoch: int) -> dict:
    """The run's summary record (parameters gathered from every process for the digest)."""
    records_, run, host = prog["records"], prog["run"], parallel.gather(p)
    return {"kind": "summary", "config": config, "steps": run, "steps_applied": run - len(prog["skipped"]),
            "steps_taken": prog["done"], "epochs_run": prog["done"] / steps_per_epoch,
            "skipped_steps": prog["skipped"],
            "test_accuracy": records_[-1]["test_accuracy"] if records_ else None,
            **({"evaluated": records_[-1]["evaluated"], "test_accuracy_worker0": records_[-1]["test_accuracy_worker0"]}
               if records_ and "evaluated" in records_[-1] else {}),
            "train_loss": records_[-1]["train_loss"] if records_ else None,
            "payload_bytes_per_step": prog["bytes_per_step"],
            "payload_bytes_mean_per_step": prog["bytes_total"] / max(run, 1),
            "dense_bytes_per_step": dense_bytes,
            "compression_ratio": dense_bytes / (prog["bytes_total"] / run) if prog["bytes_total"] else None,
            "params_finite": all(np.isfinite(x).all() for x in jax.tree.leaves(host)),
            "params_sha256": digest(host),
            "wall_s": time.time() - t_start}
