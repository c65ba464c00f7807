"""The device check: what a lent GPU or TPU should measure, in one run of under 8 minutes, as one report.

    python -m experiments.benchmarks.device_check              # on the accelerator (about 5 minutes)
    python -m experiments.benchmarks.device_check --dry-run    # the same script on CPU, tiny settings

Three sections, each the project's own benchmark or job called as a function (nothing is re-implemented
here), each timed and run even when an earlier one failed (a failure is recorded with its first line):

1. **memory** (first: the device's peak-memory counter then holds this step alone): the memory
   benchmark's training step (:mod:`experiments.benchmarks.memory`: the 1B LM, ``--memory-method``
   (default ``dense``: ``cj.identity`` then AdamW), mixed precision, the replicated layout on a
   ``1 x D`` mesh of the D devices, one sequence of 1,024 tokens per device), compiled ahead of time
   with the compiler's defaults: the AOT figure is :func:`experiments.benchmarks.memory.memory_row`
   of that compiled step (``peak = argument + output - alias + temp``, bytes of one device).  Then the
   same compiled step runs ``--memory-steps`` times on real arrays (parameters drawn N(0, 0.02²),
   optimizer state and tokens zeros: memory, not training) and the device's allocator reports its
   peak (``device.memory_stats()["peak_bytes_in_use"]`` less the bytes in use before the inputs were
   made): ``measured / aot`` says how far XLA's buffer assignment is from what the runtime
   allocates.  A backend without memory statistics (CPU) reports none.
2. **compressors**: :func:`experiments.benchmarks.compressors.run` on the ResNet-18 tree, every
   compressor against the elementwise floor (one pass reading two trees and writing one: what HBM
   bandwidth allows), ``--repeats`` rounds, with the benchmark's targets; the floor's bandwidth in
   GB/s (12 bytes per parameter over its median time) is set beside the device's nominal HBM
   bandwidth where :data:`NOMINAL_HBM` knows the device.  The main-job-step section is left out (the
   main job runs below).
3. **main job**: :func:`experiments.train.run_config`: the Fashion-MNIST CNN with ``--compressor``
   on every device, ``--train-steps`` steps of one epoch (the data must be on the machine:
   ``--data-dir``, the Debian package or the cache; never downloaded here).

``--dry-run`` runs the same three sections on tiny settings (the memory benchmark's ``tiny`` model,
the benchmark's ``--small`` tree with two compressors and one round, 3 steps of the main job on 512
images); the full test tier runs it.  Writes ``device_check.json`` (every number, the command,
provenance, each section's wall time) and ``device_check.md`` to ``runs/device_check`` (git-ignored)
or ``--out-dir``, and the main job's JSONL record beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from experiments.cpu_devices import force_cpu_devices

if __name__ == "__main__":  # on CPU (the dry run), 8 simulated workers as the other scripts use
    force_cpu_devices(8)

import jax
import jax.numpy as jnp
import numpy as np

from experiments import config_cli, records

PROG = "python -m experiments.benchmarks.device_check"
#: The whole check must fit in this many seconds on the device (the report says whether it did).
BUDGET_S = 480
#: Nominal HBM bandwidth (bytes/s) by a substring of ``device_kind``: the vendors' data sheets.
NOMINAL_HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "TPU v5p": 2.765e12, "TPU v5 lite": 8.19e11,
               "TPU v4": 1.2e12, "TPU v6": 1.64e12}
#: Sections of the compressor benchmark left out: the main job's 8-worker step (section 3 runs the main job).
COMPRESSOR_SKIP = ("main-job step (CNN, 8 workers): compile and step time",)
#: The dry run's settings: (memory size, compressors, compressor sections kept, main-job steps and images).
DRY = {"size": "tiny", "only": "identity,topk(0.01)", "repeats": 1, "train_steps": 3, "train_limit": 512,
       "batch_size": 64, "memory_steps": 2}
FULL = {"size": "1B", "only": "", "repeats": 5, "train_steps": 200, "train_limit": None, "batch_size": 256,
        "memory_steps": 3}


# --- 1. memory: the AOT figure of the memory benchmark beside the allocator's peak ---------------------------


def _device_bytes() -> tuple[int | None, int | None]:
    """``(bytes_in_use, peak_bytes_in_use)`` of the first device, or ``(None, None)`` without statistics."""
    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None, None
    return int(stats.get("bytes_in_use", 0)), int(stats.get("peak_bytes_in_use", 0))


def _materialize(structs, key) -> tuple:
    """Arrays for the step's abstract inputs ``(params, opt_state, batch)``, each with its sharding: the
    floating-point parameters drawn N(0, 0.02²), everything else zeros (one compiled program, no host copy)."""
    params, state, batch = structs
    shardings = jax.tree.map(lambda x: x.sharding, structs)

    def make(key):
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(key, len(leaves))
        p = [0.02 * jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
             else jnp.zeros(x.shape, x.dtype) for k, x in zip(keys, leaves)]
        def zeros(t):
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), t)

        return jax.tree.unflatten(tree, p), zeros(state), zeros(batch)

    return jax.jit(make, out_shardings=shardings)(key)


def memory_section(size: str, method: str, steps: int) -> dict:
    """Section 1: the memory benchmark's step of ``size`` with ``method`` (see the module docstring)."""
    from compjax import parallel
    from experiments.benchmarks import memory

    devices = len(jax.devices())
    mesh = parallel.make_2d_mesh(1, devices)
    built = memory.build(size, method, "replicated", mesh)
    t0 = time.perf_counter()
    lowered = built.step.lower(*built.inputs)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=memory.compiler_options())
    row = memory.memory_row(built, compiled, lower_s=t1 - t0, compile_s=time.perf_counter() - t1)
    before, _ = _device_bytes()
    args = _materialize(built.inputs, jax.random.key(0))
    after_inputs, _ = _device_bytes()
    losses, t2 = [], time.perf_counter()
    params, state, batch = args
    for _ in range(steps):
        params, state, loss = compiled(params, state, batch)
        losses.append(float(np.asarray(loss).mean()))
    step_s = (time.perf_counter() - t2) / max(steps, 1)
    _, peak = _device_bytes()
    measured = None if peak is None else peak - before
    return {
        "aot": row, "steps": steps, "loss": losses, "step_s": step_s,
        "bytes_in_use_before_inputs": before, "bytes_in_use_after_inputs": after_inputs,
        "peak_bytes_in_use": peak, "measured_peak": measured,
        "measured_over_aot": None if measured is None else measured / row["peak"],
        "note": "" if measured is not None else f"the {jax.default_backend()} backend reports no memory statistics",
    }


# --- 2. compressors against the elementwise floor ------------------------------------------------------------


def compressor_section(small: bool, only: str, repeats: int, skip: tuple[str, ...]) -> dict:
    """Section 2: :func:`experiments.benchmarks.compressors.run` and its targets, the floor's bandwidth."""
    from experiments.benchmarks import compressors as bench

    argv = ["--repeats", str(repeats), *(["--only", only] if only else []), *(["--small"] if small else []),
            "--skip", ",".join(skip)]
    args = argparse.Namespace(repeats=repeats, only=only, skip=",".join(skip), small=small, argv=argv)
    result = bench.run(args)
    result["targets"] = bench.targets(result)
    floor = result["rows"][0]
    floor_bw = 12 * result["tree"]["params"] / (floor["ms_median"] / 1e3)
    kind = jax.devices()[0].device_kind
    nominal = next((bw for name, bw in NOMINAL_HBM.items() if name in kind), None)
    result["floor_bytes_per_s"] = floor_bw
    result["nominal_hbm_bytes_per_s"] = nominal
    result["floor_fraction_of_nominal"] = None if nominal is None else floor_bw / nominal
    return result


# --- 3. the main job ------------------------------------------------------------------------------------------


def main_job_section(compressor: str, steps: int, train_limit: int | None, batch_size: int, out: Path,
                     data_dir: Path | None) -> dict:
    """Section 3: :func:`experiments.train.run_config`, one epoch cut at ``steps`` steps."""
    from experiments import train

    config = train.default_config()
    config.compressor.name = compressor
    config.epochs, config.max_steps, config.batch_size = 1, steps, batch_size
    if train_limit is not None:
        config.train_limit = train_limit
    summary = train.run_config(config, out=out, command=f"{PROG} (main job section)", data_dir=data_dir,
                               no_download=True)
    keep = ("steps", "steps_applied", "test_accuracy", "train_loss", "payload_bytes_mean_per_step",
            "dense_bytes_per_step", "compression_ratio", "params_finite", "wall_s")
    return {"compressor": compressor, "record": str(out), **{k: summary.get(k) for k in keep}}


# --- the report -----------------------------------------------------------------------------------------------


def _timed(fn: Callable[[], dict]) -> dict:
    """``fn()`` with ``wall_s``; an exception becomes ``{"error": "Type: first line", "traceback": ...}``."""
    t0 = time.perf_counter()
    try:
        out = {"ok": True, **fn()}
    except Exception as e:  # noqa: BLE001 - recorded in the report, and the other sections still run
        first = str(e).splitlines()[0] if str(e) else ""
        out = {"ok": False, "error": f"{type(e).__name__}: {first}", "traceback": traceback.format_exc()}
    out["wall_s"] = time.perf_counter() - t0
    return out


def _bytes(x) -> str:
    """``x`` bytes in GiB (MiB below one GiB), or ``n/a``."""
    if x is None:
        return "n/a"
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.2f} MiB"


def markdown(result: dict) -> str:
    """``device_check.md``: the machine, then one short table per section."""
    m, s = result["machine"], result["sections"]
    title = f"# Device check ({'dry run, ' if result['dry_run'] else ''}{m['backend']}: {m['device']} x {m['devices']})"
    budget = f"{'within' if result['within_budget'] else 'over'} the {BUDGET_S} s budget"
    lines = [title, "", f"`{result['command']}`: {result['wall_s']:.0f} s ({budget}).", ""]
    for name, sec in s.items():
        lines.append(f"## {name} ({sec['wall_s']:.0f} s)")
        lines.append("")
        if not sec["ok"]:
            lines += [f"**failed**: {sec['error']}", ""]
            continue
        if name == "memory":
            a, ratio = sec["aot"], sec["measured_over_aot"]
            cells = [f"{a['size']} {a['method']} {a['layout']} {a['mesh']}", _bytes(a["peak"]),
                     _bytes(a["argument"]), _bytes(a["temp"]), _bytes(sec["measured_peak"]),
                     "n/a" if ratio is None else f"{ratio:.2f}", f"{sec['step_s'] * 1e3:.0f} ms"]
            lines += ["| step | AOT peak | AOT argument | AOT temp | measured peak | measured / AOT | step time |",
                      "|---|---|---|---|---|---|---|", "| " + " | ".join(cells) + " |", ""]
            if sec["note"]:
                lines += [sec["note"] + ".", ""]
        elif name == "compressors":
            bw, nominal = sec["floor_bytes_per_s"], sec["nominal_hbm_bytes_per_s"]
            of = (f" ({sec['floor_fraction_of_nominal']:.0%} of the nominal {nominal / 1e12:.2f} TB/s)"
                  if nominal else "")
            floor = (f"Floor: {sec['rows'][0]['ms_median']:.3f} ms for {sec['tree']['params']:,} parameters, "
                     f"{bw / 1e9:.1f} GB/s{of}.")
            lines += [floor, "", "| compressor | ms | x floor |", "|---|---|---|"]
            lines += [f"| {r['name']} | {r['ms_median']:.3f} | {r['x_floor']:.2f} |" for r in sec["rows"][1:]]
            lines += ["", "| target | row | measured | met |", "|---|---|---|---|"]
            lines += [f"| {t['target']} | {t['row']} | {t['measured']} | {t['met']} |" for t in sec["targets"]]
            lines.append("")
        else:
            ratio = sec["compression_ratio"]
            cells = [sec["compressor"], str(sec["steps"]), f"{sec['test_accuracy']:.4f}", f"{sec['train_loss']:.4f}",
                     f"{sec['payload_bytes_mean_per_step']:,.0f}", "n/a" if ratio is None else f"{ratio:.1f}x",
                     f"{sec['wall_s']:.0f} s"]
            lines += ["| compressor | steps | test accuracy | train loss | bytes/step/worker | ratio | wall |",
                      "|---|---|---|---|---|---|---|", "| " + " | ".join(cells) + " |", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = config_cli.OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny settings (CPU): the tests run it")
    p.add_argument("--memory-method", default="dense", help="the memory benchmark's method (METHODS) for section 1")
    p.add_argument("--compressor", default="topk", help="the main job's compressor (section 3)")
    p.add_argument("--repeats", type=int, default=None, help="compressor benchmark rounds (default 5; dry run 1)")
    p.add_argument("--sections", default="memory,compressors,main_job", help="comma-separated, of the three")
    p.add_argument("--data-dir", type=Path, default=None, help="Fashion-MNIST's folder (never downloaded here)")
    p.add_argument("--out-dir", type=Path, default=None, help="where to write (default: runs/device_check/)")
    args = p.parse_args(argv)
    sections = [x for x in args.sections.split(",") if x]
    bad = [x for x in sections if x not in ("memory", "compressors", "main_job")]
    if bad:
        p.error(f"--sections: unknown {bad}, known ['memory', 'compressors', 'main_job']")
    from experiments.benchmarks import memory

    if args.memory_method not in memory.METHODS:
        p.error(f"--memory-method must be one of {list(memory.METHODS)}, got {args.memory_method!r}")
    cfg = DRY if args.dry_run else FULL
    repeats = args.repeats if args.repeats is not None else cfg["repeats"]
    if repeats < 1:
        p.error(f"--repeats must be an integer >= 1, got {repeats}")
    out_dir = args.out_dir if args.out_dir is not None else records.RUNS / "device_check"
    out_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join([*PROG.split(), *argv])
    t0 = time.perf_counter()
    runs = {
        "memory": lambda: memory_section(cfg["size"], args.memory_method, cfg["memory_steps"]),
        "compressors": lambda: compressor_section(args.dry_run, cfg["only"], repeats,
                                                  COMPRESSOR_SKIP + (tuple(_all_sections()) if args.dry_run else ())),
        "main_job": lambda: main_job_section(args.compressor, cfg["train_steps"], cfg["train_limit"],
                                             cfg["batch_size"], out_dir / "main_job.jsonl", args.data_dir),
    }
    done = {}
    for name in sections:
        print(f"device check: {name} ...", file=sys.stderr, flush=True)
        done[name] = _timed(runs[name])
        print(f"device check: {name}: {'ok' if done[name]['ok'] else done[name]['error']} "
              f"({done[name]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    d = jax.devices()[0]
    result = {"command": command, "dry_run": args.dry_run,
              "machine": {"jax": jax.__version__, "backend": jax.default_backend(), "device": d.device_kind,
                          "devices": len(jax.devices()), "cpu_count": os.cpu_count()},
              "sections": done, "wall_s": time.perf_counter() - t0}
    result["within_budget"] = result["wall_s"] <= BUDGET_S
    result["provenance"] = records.provenance(command)
    (out_dir / "device_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = markdown(result)
    (out_dir / "device_check.md").write_text(md)
    print(md, end="")
    print(f"wrote {out_dir}/device_check.{{json,md}}", file=sys.stderr)
    return result


def _all_sections() -> list[str]:
    from experiments.benchmarks import compressors as bench

    return list(bench.SECTIONS)


if __name__ == "__main__":
    main()
