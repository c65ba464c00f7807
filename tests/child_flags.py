"""``XLA_FLAGS`` for the processes a test starts: the test process's flags without its device count.

The root conftest.py gives the test process XLA:CPU's fast-compile flags (and its scheduler and collective
time-out settings); a process a test starts with a device count of its own keeps those flags, so its compiles
take about half the time (the same computation up to rounding where XLA computes one expression twice).
"""

from __future__ import annotations

import os

COUNT = "--xla_force_host_platform_device_count"


def xla_flags(devices: int | None = None) -> str:
    """This process's ``XLA_FLAGS`` without its device count, plus ``devices`` CPU devices if given.

    Args:
      devices: the simulated CPU devices of the child process (an integer >= 1), or None to name no count (the
        child's own script sets it, or it gets XLA's one device).

    Returns:
      The value for the child's ``XLA_FLAGS``: space-separated ``--flag=value`` items.

    Raises:
      ValueError: ``devices`` is not None nor an integer >= 1.
    """
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise ValueError(f"devices must be None or an integer >= 1, got {devices!r}")
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(COUNT)]
    return " ".join([*kept, *([f"{COUNT}={devices}"] if devices is not None else [])])
