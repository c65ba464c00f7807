"""Meshes for the data-parallel steps: a 1-D worker mesh, a ``slow x fast`` two-level mesh, and the worker axes.

:func:`make_mesh` lays every device on one worker axis (``"data"``);
:func:`make_2d_mesh` lays them out as hosts (the slow axis, between which
compressors send) by devices inside each host (the fast axis).
:func:`worker_axes` says which mesh axes the leading worker axis of the
layout (:mod:`compjax.parallel.placement`) runs over.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(num_workers: int | None = None, axis_name: str = "data") -> Mesh:
    """A 1-D mesh of ``num_workers`` devices (default: all) with axis ``axis_name``.

    On the CPU backend it warns once when XLA:CPU's thread pool is too small
    for the devices (:func:`check_cpu_pool`).

    The axis is of type ``Auto``: arrays the data-parallel steps return (worker-stacked,
    sharded over the axis) can be indexed and reduced on the host (``loss[0]``,
    ``metrics.compute()``), which JAX's default ``Explicit`` axes refuse without an
    ``out_sharding``.

    Raises:
      ValueError: ``num_workers`` < 1 or more than the available devices.
    """
    n_dev = len(jax.devices())
    n = n_dev if num_workers is None else int(num_workers)
    if not 1 <= n <= n_dev:
        raise ValueError(f"num_workers must be in [1, {n_dev}] (the available devices), got {num_workers}")
    # Auto axes (not JAX's default Explicit): the worker-stacked arrays a step returns then read on the host
    # like any array (``loss[0]``, ``int(state.step[0])``, flax metrics' reset), with no out_sharding needed.
    mesh = jax.make_mesh((n,), (axis_name,), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))
    check_cpu_pool(mesh)
    return mesh


def make_2d_mesh(slow: int, fast: int, *, slow_axis: str = "data", fast_axis: str = "fast") -> Mesh:
    """A ``slow x fast`` mesh: a slow axis between hosts, a fast axis inside each host.

    Devices are taken in (process, device id) order and laid out row-major, so
    each row (the ``fast`` devices that share a ``slow`` index) lies inside one
    process whenever ``fast`` divides the devices of a process: the fast axis
    then stays on the host's own interconnect (NVLink, ICI) and only the slow
    axis crosses the network.

    Args:
      slow: size of the slow axis (hosts or slices), >= 1.
      fast: size of the fast axis (devices per host), >= 1.
      slow_axis: name of the slow axis; compressors take it as ``axis_name``.
      fast_axis: name of the fast axis.

    Returns:
      A ``jax.sharding.Mesh`` with axes ``(slow_axis, fast_axis)`` over the
      first ``slow * fast`` devices.

    Raises:
      ValueError: a size < 1, ``slow * fast`` more than the available devices,
        equal axis names, or a fast row that would straddle two processes.

    Examples:
      >>> from compjax import parallel
      >>> mesh = parallel.make_2d_mesh(2, 4)     # 8 devices: 2 "hosts" of 4
      >>> dict(mesh.shape)
      {'data': 2, 'fast': 4}
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    for name, v in (("slow", slow), ("fast", fast)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1 (devices along the {name} axis), got {v}")
    if slow * fast > len(devices):
        raise ValueError(f"slow x fast = {slow} x {fast} = {slow * fast} devices, but only {len(devices)} are "
                         "available")
    if slow_axis == fast_axis:
        raise ValueError(f"slow_axis and fast_axis must differ, both are {slow_axis!r}")
    grid = np.array(devices[: slow * fast], dtype=object).reshape(slow, fast)
    for row in grid:
        if len({d.process_index for d in row}) > 1:
            raise ValueError(f"fast = {fast} devices per row straddles processes (each process has "
                             f"{jax.local_device_count()} devices): choose a fast size that divides it")
    mesh = Mesh(grid, (slow_axis, fast_axis))
    check_cpu_pool(mesh)
    return mesh


def fast_names(fast: Any) -> tuple:
    """The fast mesh axes as a tuple: ``"fast"`` -> ``("fast",)``; a tuple (or list) of several as a tuple."""
    return tuple(fast) if isinstance(fast, (tuple, list)) else (fast,)


def worker_axes(mesh: Mesh, axis_name: str, fast_axis: Any) -> tuple[int, Any]:
    """``(n, spec entry)``: the number of workers and the mesh axes the worker axis is sharded over.

    ``fast_axis`` is None, one fast axis, or a tuple of several (a host is their devices together).
    """
    if fast_axis is None:
        return mesh.shape[axis_name], axis_name
    names = fast_names(fast_axis)
    return mesh.shape[axis_name] * int(np.prod([mesh.shape[a] for a in names])), (axis_name, *names)


def check_fast_axes(mesh: Mesh, fast_axis: Any, axis_name: str) -> tuple:
    """``fast_axis`` (one axis name or a tuple of several) checked against ``mesh``, as a tuple.

    Raises:
      ValueError: an axis not in ``mesh``, the worker axis ``axis_name``, an
        empty tuple or an axis named twice; or a fast axis of type
        ``Explicit`` (the sharded step leaves the fast axes to XLA's sharding
        propagation, which needs them ``Auto``).
    """
    names = fast_names(fast_axis)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"fast_axis must be a mesh axis or a tuple of distinct ones, got {fast_axis!r}")
    for a in names:
        if a not in mesh.axis_names:
            raise ValueError(f"fast_axis={fast_axis!r} names {a!r}, not an axis of the mesh, whose axes are "
                             f"{mesh.axis_names}")
        if a == axis_name:
            raise ValueError(f"fast_axis and axis_name must differ, both name {axis_name!r}")
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    explicit = [a for a in names if types.get(a) == AxisType.Explicit and mesh.shape[a] > 1]
    if explicit:
        raise ValueError(f"fast axes {explicit} of the mesh are of type Explicit: the sharded step leaves them to "
                         "XLA's sharding propagation, which needs them Auto. Build the mesh with "
                         "parallel.make_2d_mesh(slow, fast), or jax.make_mesh(..., axis_types="
                         "(jax.sharding.AxisType.Auto,) * ndim)")
    return names


def check_axis(mesh: Mesh, axis_name: str) -> None:
    """Raise a ValueError unless ``axis_name`` is an axis of ``mesh`` (the message names the mesh's axes)."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh, whose axes are {mesh.axis_names}")


#: The collective time-out flag of XLA:CPU (jaxlib 0.10.2): seconds a device waits in a rendezvous, after the
#: "may be stuck" warning (20 s), before XLA aborts the process (default 40).
TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"

_pool_warned: list = []  # one warning per process


def cpu_pool_threads(devices: int) -> int:
    """The threads of XLA:CPU's pool for ``devices`` devices: ``max(PJRT_NPROC or the cores, devices)``.

    ``PJRT_NPROC`` (an environment variable read when JAX's CPU client starts)
    or, unset, the cores this process may run on.

    Args:
      devices: the CPU devices of the process (``jax.local_device_count()``).

    Returns:
      The pool's thread count (an int >= ``devices``).
    """
    try:
        nproc = int(os.environ.get("PJRT_NPROC", "0"))
    except ValueError:
        nproc = 0
    if nproc <= 0:
        nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(nproc, devices)


def check_cpu_pool(mesh: Mesh) -> None:
    """Warn once (``UserWarning``) when XLA:CPU's thread pool is too small for the simulated devices of ``mesh``.

    XLA:CPU (jaxlib 0.10.2) runs every device's part of a program, and every
    launch of a program, on one pool of ``max(PJRT_NPROC or the cores,
    devices)`` threads.  With fewer than twice as many threads as devices, a
    queued launch can hold the thread one device of a running program needs:
    the other devices wait in its collective's rendezvous and XLA aborts the
    process ("Termination timeout for `all reduce RendezvousKey{...}` of 40
    seconds exceeded ... only 6 of them arrived"), most often on a loaded
    machine.  Nothing to check on GPU or TPU, or with one device.

    Args:
      mesh: the mesh the step will run on.
    """
    devices = list(np.asarray(mesh.devices).flat)
    if _pool_warned or len(devices) < 2 or devices[0].platform != "cpu":
        return
    local = jax.local_device_count()
    threads = cpu_pool_threads(local)
    if threads >= 2 * local:
        return
    _pool_warned.append(True)
    warnings.warn(
        f"XLA:CPU runs the programs of this process's {local} devices on a pool of {threads} threads "
        f"(max(PJRT_NPROC or the cores, devices)): with fewer than {2 * local}, a queued launch can hold the thread "
        f"one device of a running program needs, and XLA aborts the process when that program's collective waits "
        f"too long ('Termination timeout ... Expected {local} threads to join the rendezvous'). Set "
        f"PJRT_NPROC={2 * local} in the environment before JAX starts (os.environ['PJRT_NPROC'] = '{2 * local}' "
        f"before importing jax), and on a loaded machine raise XLA's time-out with "
        f"XLA_FLAGS='{TIMEOUT_FLAG}=300'",
        UserWarning, stacklevel=3)
