"""The simulated CPU devices: the scripts' thread pool that cannot deadlock, the collective time-out XLA honours, and
the warning compjax gives a program whose pool is too small."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cpu_devices import COLLECTIVE_TIMEOUT_S, TIMEOUT_FLAG, force_cpu_devices

ROOT = Path(__file__).resolve().parents[1]


def test_a_fresh_process_gets_the_devices_and_twice_as_many_pool_threads():
    code = ("from experiments.cpu_devices import force_cpu_devices\n"
            "print(force_cpu_devices(3), force_cpu_devices(5))\n"
            "import os, jax\n"
            "print(jax.device_count(), os.environ['PJRT_NPROC'], os.environ['XLA_FLAGS'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split("\n")
    assert out[0] == "True False"  # the second call: the device count is already given
    count, nproc, flags = out[1].split(" ", 2)
    assert (count, nproc) == ("3", "6")
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in flags
    assert f"{TIMEOUT_FLAG}={COLLECTIVE_TIMEOUT_S}" in flags


def test_after_jax_started_nothing_is_changed():
    code = ("import os, jax\n"
            "from experiments.cpu_devices import force_cpu_devices\n"
            "print(force_cpu_devices(3), os.environ.get('XLA_FLAGS'), os.environ.get('PJRT_NPROC'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "None", "None"]


def test_a_bad_count_names_the_parameter():
    for n in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            force_cpu_devices(n)


LATE_DEVICE = """
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
def late(i):  # device 0 reaches the all-reduce {late} s after the others
    if int(i) == 0:
        time.sleep({late})
    return np.float32(1.0)
def body(x):
    y = jax.pure_callback(late, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.axis_index("d"))
    return jax.lax.psum(x * y, "d")
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P()))
print("sum", float(jax.block_until_ready(f(jnp.arange(4.0)))[0]))
"""


@pytest.mark.slow  # two processes, a device held back a few seconds
def test_the_collective_time_out_flag_is_the_one_xla_aborts_on():
    """A device late to an all-reduce: XLA:CPU aborts the process once the others have waited the "may be stuck"
    time plus the flag's seconds; with more seconds the late device arrives and the sum comes out."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    warn = "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1"  # the 20 s before the count starts, cut to 1
    code = "from experiments.cpu_devices import force_cpu_devices\nforce_cpu_devices(4)\n" + LATE_DEVICE
    short = subprocess.run([sys.executable, "-c", code.format(late=4)], cwd=ROOT, capture_output=True, text=True,
                           check=False, timeout=300, env={**env, "XLA_FLAGS": f"{warn} {TIMEOUT_FLAG}=1"})
    assert short.returncode != 0 and "Termination timeout" in short.stderr, short.stderr[-2000:]
    raised = subprocess.run([sys.executable, "-c", code.format(late=4)], cwd=ROOT, capture_output=True, text=True,
                            check=False, timeout=300, env={**env, "XLA_FLAGS": f"{warn} {TIMEOUT_FLAG}=8"})
    assert raised.returncode == 0 and "sum 6.0" in raised.stdout, raised.stderr[-2000:]


def test_make_mesh_warns_once_when_the_cpu_pool_is_too_small(monkeypatch):
    import warnings

    import jax

    from compjax import parallel
    from compjax.parallel import mesh as mesh_mod

    n = jax.local_device_count()
    monkeypatch.setattr(mesh_mod, "_pool_warned", [])
    monkeypatch.setenv("PJRT_NPROC", str(2 * n))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.make_mesh()
        parallel.make_2d_mesh(2, n // 2)
    monkeypatch.setenv("PJRT_NPROC", str(2 * n - 1))
    with pytest.warns(UserWarning, match=rf"pool of {2 * n - 1} threads.*Set PJRT_NPROC={2 * n}.*"
                                         rf"{TIMEOUT_FLAG}=300"):
        parallel.make_mesh()
    with warnings.catch_warnings():  # once per process
        warnings.simplefilter("error")
        parallel.make_mesh()
    monkeypatch.setattr(mesh_mod, "_pool_warned", [])
    monkeypatch.delenv("PJRT_NPROC")  # the cores, then: this machine's, when fewer than twice the devices
    cores = len(os.sched_getaffinity(0))
    assert mesh_mod.cpu_pool_threads(n) == max(cores, n)
    if max(cores, n) < 2 * n:
        with pytest.warns(UserWarning, match=rf"pool of {max(cores, n)} threads"):
            parallel.make_2d_mesh(2, n // 2)
