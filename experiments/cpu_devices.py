"""Simulated CPU devices for the scripts of ``experiments/``: set before JAX starts, ignored by GPU/TPU backends.

A script calls :func:`force_cpu_devices` before its first ``import jax``::

    from experiments.cpu_devices import force_cpu_devices

    if __name__ == "__main__":
        force_cpu_devices(8)

    import jax
"""

from __future__ import annotations

import os
import sys

__all__ = ["COLLECTIVE_TIMEOUT_S", "TIMEOUT_FLAG", "force_cpu_devices"]

#: XLA:CPU's flag (jaxlib 0.10.2) for the seconds a device waits in a collective's rendezvous, after its 20 s
#: "may be stuck" warning, before XLA aborts the process (default 40).  The same name as
#: ``compjax.parallel.mesh.TIMEOUT_FLAG``; written out here because this module runs before JAX is imported.
TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
#: What the scripts and the tests raise it to: a starved device's thread arrives, a real deadlock still ends.
COLLECTIVE_TIMEOUT_S = 300


def force_cpu_devices(n: int, *, concurrency_optimized_scheduler: bool = False) -> bool:
    """Ask XLA:CPU for ``n`` devices, unless JAX has started or ``XLA_FLAGS`` already names a device count.

    Sets ``--xla_force_host_platform_device_count=n`` in ``XLA_FLAGS``, and
    ``PJRT_NPROC`` to ``2 n`` unless it is set.  XLA:CPU (jaxlib 0.10.2) runs
    every device's part of a program, and every launch of a program, on one
    pool of ``max(PJRT_NPROC or the cores, devices)`` threads; with as many
    threads as devices, a queued launch can hold the thread that one device
    of a running program with collectives needs, and the program deadlocks
    (XLA aborts it after 40 s).  Twice the devices leaves room for both.
    On a loaded machine a device's thread can also start late; XLA then
    aborts a collective the other devices have waited in for 20 s + 40 s:
    ``--xla_cpu_collective_call_terminate_timeout_seconds`` raises the 40 s
    to :data:`COLLECTIVE_TIMEOUT_S`, unless ``XLA_FLAGS`` already sets it.

    Args:
      n: devices, an integer >= 1.
      concurrency_optimized_scheduler: keep XLA:CPU's concurrency-optimized
        scheduler on (False: ``--xla_cpu_enable_concurrency_optimized_scheduler=false``,
        the setting the tests and the memory benchmark run with; it has crashed
        programs with several wrapped compressors side by side).

    Returns:
      True when the flags were set; False when JAX was already imported (too
      late: the device count is fixed when its CPU backend starts) or the
      device count was given in ``XLA_FLAGS``.

    Raises:
      ValueError: ``n`` is not an integer >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1 (the simulated CPU devices), got {n!r}")
    if "jax" in sys.modules or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return False
    flags = [f"--xla_force_host_platform_device_count={n}"]
    if TIMEOUT_FLAG not in os.environ.get("XLA_FLAGS", ""):
        flags.append(f"{TIMEOUT_FLAG}={COLLECTIVE_TIMEOUT_S}")
    if not concurrency_optimized_scheduler:
        flags.append("--xla_cpu_enable_concurrency_optimized_scheduler=false")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    os.environ.setdefault("PJRT_NPROC", str(2 * n))
    return True
