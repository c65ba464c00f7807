"""Alpha-beta network model: (collective kind, bytes, workers) -> seconds.

A message of ``b`` bytes over one link costs ``latency + b / bandwidth``
(Hockney's alpha-beta model).  The collectives use the textbook algorithms
(Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 2005; Patarasuk & Yuan 2009 for the ring):

* ring all-reduce of ``b`` bytes per worker: ``2 (n-1)`` steps of ``b/n`` bytes
  (reduce-scatter + all-gather) -> ``2 (n-1) latency + 2 (n-1)/n * b / bandwidth``;
* ring all-gather of ``b`` bytes per worker: ``(n-1)`` steps of ``b`` bytes
  -> ``(n-1) latency + (n-1) * b / bandwidth``;
* parameter server (one server link is the bottleneck): ``n`` workers push ``b``
  bytes and pull the ``b_out`` byte result -> ``2 latency + n (b + b_out) / bandwidth``.

Bandwidth is in bytes per second of one worker's link (both directions at full
rate), latency in seconds.  ``n = 1`` costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from compjax._checks import check_range

__all__ = ["Network", "allgather_time", "allreduce_time", "collective_time", "parameter_server_time", "step_time"]


class Network(NamedTuple):
    """A homogeneous network.

    Attributes:
      bandwidth: bytes per second of each worker's link (e.g. ``10e9 / 8`` for 10 Gbit/s).
      latency: seconds per message (alpha).
    """

    bandwidth: float
    latency: float = 0.0

    @classmethod
    def from_gbit(cls, gbit_per_s: float, latency_us: float = 0.0) -> Network:
        """A network of ``gbit_per_s`` Gbit/s links and ``latency_us`` microseconds per message."""
        return cls(bandwidth=gbit_per_s * 1e9 / 8, latency=latency_us * 1e-6)


def _check(nbytes, workers, net):
    check_range("nbytes", nbytes, 0, None)
    check_range("workers", workers, 1, None, integer=True)
    check_range("bandwidth", net.bandwidth, 0, None, lo_open=True)
    check_range("latency", net.latency, 0, None)


def allreduce_time(nbytes: float, workers: int, net: Network) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` bytes per worker over ``workers`` workers.

    Raises:
      ValueError: negative ``nbytes``, ``workers < 1``, ``bandwidth <= 0`` or ``latency < 0``.
    """
    _check(nbytes, workers, net)
    n = int(workers)
    if n == 1:
        return 0.0
    return 2 * (n - 1) * net.latency + 2 * (n - 1) / n * nbytes / net.bandwidth


def allgather_time(nbytes: float, workers: int, net: Network) -> float:
    """Seconds of a ring all-gather where each worker contributes ``nbytes`` bytes.

    Raises:
      ValueError: as :func:`allreduce_time`.
    """
    _check(nbytes, workers, net)
    n = int(workers)
    if n == 1:
        return 0.0
    return (n - 1) * net.latency + (n - 1) * nbytes / net.bandwidth


def parameter_server_time(nbytes: float, workers: int, net: Network, result_bytes: float | None = None) -> float:
    """Seconds of a push/pull through one parameter server whose link is shared by all workers.

    Args:
      nbytes: bytes each worker pushes.
      workers: number of workers n.
      net: the network (the server's link has the same bandwidth as a worker's).
      result_bytes: bytes each worker pulls back (default: ``nbytes``).

    Raises:
      ValueError: as :func:`allreduce_time`.
    """
    _check(nbytes, workers, net)
    n = int(workers)
    if n == 1:
        return 0.0
    out = nbytes if result_bytes is None else result_bytes
    return 2 * net.latency + n * (nbytes + out) / net.bandwidth


_TIMES = {"all-reduce": allreduce_time, "all-gather": allgather_time, "parameter-server": parameter_server_time}


def collective_time(kind: str, nbytes: float, workers: int, net: Network) -> float:
    """Seconds of one collective of ``kind`` (``"all-reduce"``, ``"all-gather"``, ``"parameter-server"``).

    Raises:
      ValueError: an unknown ``kind``, or bad numbers as :func:`allreduce_time`.
    """
    if kind not in _TIMES:
        raise ValueError(f"kind must be one of {sorted(_TIMES)}, got {kind!r}")
    return _TIMES[kind](nbytes, workers, net)


def step_time(collectives: Iterable, workers: int, net: Network) -> float:
    """Seconds of communication of a step, from :func:`compjax.audit_collectives` records.

    Each record's ``op`` picks the model and its ``bytes`` (what one worker
    contributes) the size; collectives are taken to run one after another.

    Raises:
      ValueError: a record whose ``op`` has no model here.
    """
    return sum(collective_time(c.op, c.bytes, workers, net) for c in collectives)
