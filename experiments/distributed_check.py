"""Check that a multi-process run computes what one process computes.

    python -m experiments.launch --processes 2 --devices-per-process 2 \\
        --module experiments.distributed_check -- --out runs/check_2x2
    python -m experiments.distributed_check --workers 4 --out runs/check_1x4

Each run trains a small linear model for ``--steps`` data-parallel steps with
each of ``identity``, ``topk`` and ``powersgd`` (the same seeded batches
whatever the layout) and process 0 saves every compressor's final
worker-stacked parameters to ``<out>/<compressor>.npz``.  The same number of
workers in one process or spread over several must give the same parameters up
to the order of floating-point sums in the collectives (1e-6).  On a cluster,
run it through your launcher with ``--distributed`` before a long job.
"""

from __future__ import annotations

from experiments.cpu_devices import force_cpu_devices

force_cpu_devices(4)

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax as cj
from compjax import parallel
from experiments import distributed

COMPRESSORS = {
    "identity": lambda: cj.identity("data"),
    "topk": lambda: cj.topk(0.1, axis_name="data"),
    "powersgd": lambda: cj.powersgd(2, axis_name="data"),
}


def loss_fn(p, batch):
    """Mean squared error of a linear model, ``(rows, 32) -> (rows, 16)``."""
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def run(name: str, mesh, steps: int, seed: int) -> dict:
    """``steps`` steps of SGD with momentum through compressor ``name``; the gathered parameters."""
    tx = optax.chain(COMPRESSORS[name](), optax.sgd(0.05, momentum=0.9))
    init = {"w": np.zeros((32, 16), np.float32), "b": np.zeros(16, np.float32)}
    p, s = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    step = parallel.data_parallel_step(loss_fn, tx, mesh)
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(32, 16)).astype(np.float32)
    for _ in range(steps):
        x = rng.normal(size=(8 * mesh.size, 32)).astype(np.float32)
        p, s, _ = jax.block_until_ready(step(p, s, parallel.shard_batch((x, x @ target), mesh)))
    return parallel.gather(p)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder of the <compressor>.npz files")
    ap.add_argument("--steps", type=int, default=20, help="steps per compressor (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=None, help="workers (default: every device)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compressors", nargs="+", default=list(COMPRESSORS), choices=list(COMPRESSORS))
    args = ap.parse_args(argv)
    address, count, pid = distributed.settings(None, None, None)
    if (count or 1) > 1:
        distributed.initialize(address, count, pid)
    mesh = parallel.make_mesh(args.workers)
    for name in args.compressors:
        params = run(name, mesh, args.steps, args.seed)
        if jax.process_index() == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            np.savez(args.out / f"{name}.npz", **params)
    print(f"process {jax.process_index()} of {jax.process_count()}: {mesh.size} workers, "
          f"{', '.join(args.compressors)} done", flush=True)
    if jax.process_count() > 1:
        distributed.finish()


if __name__ == "__main__":
    main()
