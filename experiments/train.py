"""The main job: data-parallel training of a Flax NNX CNN on Fashion-MNIST with a chosen compressor.

    python -m experiments.train [--compressor NAME] [options]
    python -m experiments.train --dataset cifar10 --model resnet20 --augment ...   (for accelerators)

Runs on every available device (8 simulated CPU workers when there is no
accelerator).  Prints per-epoch test accuracy, payload bytes per step per worker
and the compression ratio against the dense baseline (4 bytes x parameters),
both measured from the compressor state; writes a JSONL record (one line per
epoch, then a summary line) to ``--out``.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 8 CPU workers unless an accelerator is found (the flag only affects the CPU backend).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np
import optax
from tqdm import tqdm

import compjax as cj
from compjax import parallel
from experiments import cifar10, compressors, data, models

AXIS = "data"
#: dataset name -> loader ``(root, download=) -> (x_train, y_train, x_test, y_test)``.
DATASETS = {"fashion_mnist": data.load_fashion_mnist, "cifar10": cifar10.load_cifar10}
RESULTS = Path(__file__).resolve().parent / "results" / "runs"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    compressors.add_arguments(p)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split over the workers")
    p.add_argument("--lr", type=float, default=0.05, help="peak SGD learning rate (cosine decay)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0, help="L2 weight decay (see transform())")
    p.add_argument("--dataset", default="fashion_mnist", choices=sorted(DATASETS))
    p.add_argument("--model", default="cnn", choices=sorted(models.MODELS))
    p.add_argument("--augment", action="store_true", help="random crop (pad 4) and horizontal flip (CIFAR-10)")
    p.add_argument("--warmup-steps", type=int, default=100, help="linear learning-rate warm-up")
    p.add_argument("--lr-before-compressor", action="store_true",
                   help="scale local gradients by the learning rate before the compressor (see transform())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="default: every device")
    p.add_argument("--max-steps", type=int, default=None, help="stop early (smoke tests)")
    p.add_argument("--train-limit", type=int, default=None, help="use only the first N training images")
    p.add_argument("--data-dir", type=Path, default=None, help="directory of the IDX files")
    p.add_argument("--download", action="store_true", help="download the canonical files if missing")
    p.add_argument("--out", type=Path, default=None, help="JSONL file (default results/runs/<compressor>.jsonl)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def lr_schedule(args, steps_total: int) -> optax.Schedule:
    """Linear warm-up from 0 to ``--lr`` over ``--warmup-steps``, then cosine decay to 0 at the last step."""
    return optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(args.warmup_steps, max(1, steps_total - 1)), max(steps_total, 2)
    )


def momentum_after(args) -> float | None:
    """The momentum of the optimizer after the compressor: none when the compressor carries it (DGC)."""
    return None if compressors.momentum_inside(args.compressor) else args.momentum


def optimizer(args, steps_total: int) -> optax.GradientTransformation:
    """SGD with :func:`lr_schedule` and :func:`momentum_after`."""
    sgd = optax.sgd(lr_schedule(args, steps_total), momentum=momentum_after(args))
    return optax.chain(optax.add_decayed_weights(args.weight_decay), sgd) if args.weight_decay else sgd


def transform(args, compressor: optax.GradientTransformation, steps_total: int) -> optax.GradientTransformation:
    """The whole optax chain of a worker: local gradients in, parameter updates out.

    Default: ``chain(compressor, [weight decay], sgd(schedule, momentum))``.  With
    ``--lr-before-compressor`` the learning rate scales each worker's gradient
    *before* the compressor, so error-feedback residuals and DGC's accumulation
    hold ``lr``-weighted gradients (Lin et al. 2018, Algorithm 1; Aji & Heafield
    2017): an entry sent late is applied with the learning rate of the steps that
    produced it, not with the (decayed) rate of the step that sends it.  Then
    ``chain([weight decay], scale_by_learning_rate, compressor, [trace(momentum)])``.
    """
    if not args.lr_before_compressor:
        return optax.chain(compressor, optimizer(args, steps_total))
    momentum = momentum_after(args)
    decay = [optax.add_decayed_weights(args.weight_decay)] if args.weight_decay else []
    after = [optax.trace(decay=momentum)] if momentum else []
    return optax.chain(*decay, optax.scale_by_learning_rate(lr_schedule(args, steps_total)), compressor, *after)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    x_train, y_train, x_test, y_test = DATASETS[args.dataset](args.data_dir, download=args.download)
    if args.train_limit:
        x_train, y_train = x_train[: args.train_limit], y_train[: args.train_limit]
    mesh = parallel.make_mesh(args.workers, AXIS)
    n = mesh.shape[AXIS]
    if args.batch_size % n:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {n} workers")

    steps_per_epoch = len(x_train) // args.batch_size
    steps_total = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        steps_total = min(steps_total, args.max_steps)

    params, apply, loss_fn = models.build(args.seed, model=args.model)
    num_params = sum(int(x.size) for x in jax.tree.leaves(params))
    dense_bytes = 4 * num_params  # identity's float32 all-reduce payload
    compressor, comp_opts = compressors.build(args, AXIS)
    tx = transform(args, compressor, steps_total)

    p = parallel.replicate(params, mesh, AXIS)
    s = parallel.init_worker_state(tx, params, mesh, AXIS)
    step = parallel.data_parallel_step(loss_fn, tx, mesh, axis_name=AXIS, donate=True)

    out = args.out or RESULTS / f"{args.compressor}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"compressor": args.compressor, "options": comp_opts, "dataset": args.dataset, "model": args.model,
              "epochs": args.epochs, "weight_decay": args.weight_decay, "augment": args.augment,
              "batch_size": args.batch_size, "lr": args.lr, "momentum": args.momentum,
              "lr_before_compressor": args.lr_before_compressor,
              "warmup_steps": args.warmup_steps, "seed": args.seed, "workers": n,
              "train_images": len(x_train), "num_params": num_params, "backend": jax.default_backend()}
    print(f"compjax main job: {args.compressor} {comp_opts} | {n} workers on {jax.default_backend()} | "
          f"{num_params:,} params | {steps_total} steps", flush=True)

    rng = np.random.default_rng(args.seed)
    records, done, bytes_per_step, bytes_total = [], 0, 0, 0
    with open(out, "w") as f, tqdm(total=steps_total, disable=args.no_progress, unit="step") as bar:
        for epoch in range(args.epochs):
            if done >= steps_total:
                break
            perm = rng.permutation(len(x_train))
            losses = []
            for i in range(steps_per_epoch):
                if done >= steps_total:
                    break
                idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
                x = cifar10.random_crop_flip(x_train[idx], rng) if args.augment else x_train[idx]
                batch = parallel.shard_batch((x, y_train[idx]), mesh, AXIS)
                p, s, loss = step(p, s, batch)
                loss = jax.block_until_ready(loss)  # one collective step in flight at a time (CPU)
                bytes_per_step = int(np.asarray(cj.payload_bytes(s))[0])
                bytes_total += bytes_per_step
                losses.append(float(np.mean(np.asarray(loss))))
                done += 1
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
            acc = models.accuracy(apply, parallel.unreplicate(p), x_test, y_test)
            rec = {"kind": "epoch", "epoch": epoch + 1, "step": done, "train_loss": float(np.mean(losses)),
                   "test_accuracy": acc, "payload_bytes_per_step": bytes_per_step,
                   "compression_ratio": dense_bytes / bytes_per_step if bytes_per_step else None,
                   "wall_s": time.time() - t_start}
            records.append(rec)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            ratio = f"{rec['compression_ratio']:.1f}x" if rec["compression_ratio"] else "n/a"
            tqdm.write(f"epoch {epoch + 1}: test accuracy {acc:.4f} | train loss {rec['train_loss']:.4f} | "
                       f"payload {bytes_per_step:,} B/step/worker | ratio vs identity {ratio}")
        summary = {"kind": "summary", "config": config, "steps": done,
                   "test_accuracy": records[-1]["test_accuracy"] if records else None,
                   "payload_bytes_per_step": bytes_per_step,
                   "payload_bytes_mean_per_step": bytes_total / max(done, 1),
                   "dense_bytes_per_step": dense_bytes,
                   "compression_ratio": dense_bytes / (bytes_total / done) if bytes_total else None,
                   "wall_s": time.time() - t_start}
        f.write(json.dumps(summary) + "\n")
    ratio = f"{summary['compression_ratio']:.1f}x" if summary["compression_ratio"] else "n/a"
    print(f"SUMMARY compressor={args.compressor} options={json.dumps(comp_opts)} "
          f"test_accuracy={summary['test_accuracy']:.4f} bytes/step/worker={bytes_per_step} ratio={ratio} "
          f"wall={summary['wall_s']:.0f}s record={out}", flush=True)
    return summary


if __name__ == "__main__":
    main()
