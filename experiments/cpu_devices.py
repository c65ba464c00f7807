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

__all__ = ["force_cpu_devices"]


def force_cpu_devices(n: int, *, concurrency_optimized_scheduler: bool = False) -> bool:
    """Ask XLA:CPU for ``n`` devices, unless JAX has started or ``XLA_FLAGS`` already names a device count.

    Sets ``--xla_force_host_platform_device_count=n`` in ``XLA_FLAGS``, and
    ``PJRT_NPROC`` to ``2 n`` unless it is set.  XLA:CPU (jaxlib 0.10.2) runs
    every device's part of a program, and every launch of a program, on one
    pool of ``max(PJRT_NPROC or the cores, devices)`` threads; with as many
    threads as devices, a queued launch can hold the thread that one device
    of a running program with collectives needs, and the program deadlocks
    (XLA aborts it after 40 s).  Twice the devices leaves room for both.

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
    if not concurrency_optimized_scheduler:
        flags.append("--xla_cpu_enable_concurrency_optimized_scheduler=false")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    os.environ.setdefault("PJRT_NPROC", str(2 * n))
    return True
