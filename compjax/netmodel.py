"""Alpha-beta network model: (collective kind, bytes, workers) -> seconds, and what a step would take.

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
rate), latency in seconds per message.  ``n = 1`` costs nothing.

Two more rules, for links and hosts unlike a cluster's (:class:`Network`):

* **one shared medium** (``shared=True``): every worker's messages cross one
  link (a site's uplink, processes of one host on its loopback), so a
  collective takes the bytes of all its messages over ``bandwidth``: ``n``
  times a ring's per-link time;
* **a cost per collective call** (``call_latency``), paid once whatever the
  call's size and number of messages, and overlapping the call's bytes: a
  call takes ``max(call_latency, bytes' time)`` plus its messages'
  latencies.  This is LogP's rule for a host's overhead against the link's
  gap (Culler et al., "LogP: towards a realistic model of parallel
  computation", PPoPP 1993: successive messages are ``max(o, g)`` apart),
  applied to whole calls.

With a :class:`Framing` (:func:`collective_time`, :func:`step_time`,
:func:`predict_step`), the bytes are the wire bytes of gloo's messages, headers
included, and each operand of an audited collective is a call of its own.

**Bytes on the wire.**  :func:`wire_bytes` counts what a collective puts on the
links, all workers together, framing included: the messages of gloo's algorithms
(:func:`gloo_messages`; gloo is what JAX uses for collectives between CPU
processes) framed by :class:`Framing`.  Its constants come from the protocols'
sources and were checked against the bytes the Linux kernel counted on a
rate-limited link (below); see :class:`Framing`.

On top of the formulas: :class:`Network` presets (:meth:`Network.presets`),
:func:`predict_step` (compute + communication of one step, with and without
overlap, and the bandwidth that would hide the communication),
:func:`measure_compute_time` and :func:`compare` / :func:`to_markdown` (a table
of compressors x networks).

**Calibrated on a real link.**  ``experiments/benchmarks/link.py`` runs P = 2
and 4 processes (gloo over TCP) on a loopback shaped to 10 Mbit/s - 1 Gbit/s
and unshaped, and times the steps of a CNN and a transformer with six
compressors and DiLoCo.  What it calibrated, and from what:

* ``Framing.gloo_tcp``: the kernel's byte counts (``tc -s qdisc``; see
  :class:`Framing`): within 7.5% of :func:`wire_bytes` in every one of 112
  rows over several runs, 3.6% in the committed one;
* ``call_latency``: a probe of one-float32 all-reduces and all-gathers back
  to back at every rate (nothing to compute, next to nothing to send).  Its
  calls are bimodal, about 0.2 ms or about 4 ms (a wake-up that waits for the
  next tick of the kernel's 250 Hz timer: 2 cores shared by the processes
  and other jobs), so the cost a step pays per call is their mean, measured
  in each run: 0.7 ms at P = 2 and 1.8 ms at P = 4 on a quiet host (load
  average 0.6), 1.0 - 3.6 ms under a load average of 2.4 - 6.  The per-message latency
  this model used to fit on the unshaped rows (2.3 ms at P = 2) was mostly
  compute noise: the probe's median call takes a tenth of it.  The probe
  does not separate a per-message cost from the per-call one well (quiet, P
  = 4: an all-gather of one float, 6 half-messages per process, 4.0 ms; an
  all-reduce of one, about 1.5 messages per process, 0.7 ms), so the mean is
  charged per call and ``latency`` is 0;
* the overlap: with each call's latency added to its bytes (the alpha-beta
  sum), the compressed steps at 10 Mbit/s, bound by the link, ran 0.6 - 0.8x
  the prediction under load; with ``max`` every row at 10 and 100 Mbit/s is
  within 25% on a quiet host (56 of 56) and 54 - 55 of 56 under load
  (``experiments/results/benchmarks/link.md``).

Examples:
  What would a 10 Gbit/s network give a step that computes for 100 ms and
  all-reduces 100 MB over 8 workers?

  >>> from compjax import netmodel
  >>> from compjax.accounting import Collective
  >>> ops = [Collective("all-reduce", (("f32", (25_000_000,)),), 100_000_000, "ar")]
  >>> p = netmodel.predict_step(ops, 8, netmodel.Network.ethernet_10g, compute_s=0.1)
  >>> round(p.comm_s, 4), round(p.no_overlap_s, 4), round(p.overlap_s, 4)
  (0.1403, 0.2403, 0.1403)
  >>> round(p.hiding_bandwidth * 8 / 1e9, 2)   # Gbit/s at which the all-reduce takes 100 ms
  14.04
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from compjax._checks import check_range

__all__ = [
    "Framing",
    "Network",
    "StepPrediction",
    "allgather_time",
    "allreduce_time",
    "collective_time",
    "compare",
    "gloo_messages",
    "measure_compute_time",
    "parameter_server_time",
    "predict_step",
    "step_time",
    "to_markdown",
    "wire_bytes",
]


class Network(NamedTuple):
    """A homogeneous network: every worker has one link of ``bandwidth`` bytes/s, ``latency`` s per message.

    Attributes:
      bandwidth: bytes per second of each worker's link in each direction
        (e.g. ``10e9 / 8`` for 10 Gbit/s).
      latency: alpha, seconds per message: the fixed cost of one step of a
        collective algorithm (one send/receive between two workers, software
        stack included), paid ``2 (n-1)`` times by a ring all-reduce and
        ``n-1`` times by a ring all-gather.  Not a round-trip time.
      name: a label for tables (optional).
      shared: False (default): every worker has a link of its own (to a
        switch), and the links of a ring carry its messages at the same time.
        True: one medium of ``bandwidth`` carries every worker's traffic (one
        uplink behind which all workers sit, processes of one host on its
        loopback or NIC): a collective then takes the bytes of *all* its
        messages over ``bandwidth``, ``n`` times a ring's per-link time
        (a parameter server's is the same either way: its link carries all).

    Presets (class attributes, also listed by :meth:`presets`); bandwidths are
    line rates per direction, latencies typical per-message costs as seen by
    a collective library, so treat them as order-of-magnitude figures:

    ===================  ==============  ===========  ====================================================
    preset               bandwidth       latency      source
    ===================  ==============  ===========  ====================================================
    ``ethernet_1g``      1 Gbit/s        50 us        IEEE 802.3ab line rate; kernel TCP/IP message cost
    ``ethernet_10g``     10 Gbit/s       20 us        IEEE 802.3ae line rate; kernel TCP/IP message cost
    ``infiniband_100g``  100 Gbit/s      5 us         InfiniBand EDR 4x; NCCL's network step latency
    ``infiniband_400g``  400 Gbit/s      5 us         InfiniBand NDR 4x; NCCL's network step latency
    ``nvlink``           450 GB/s        3 us         H100 NVLink 4; NCCL's NVLink step latency
    ``tpu_dcn``          50 Gbit/s       25 us        TPU v5p data-center network per chip
    ``wan``              100 Mbit/s      110 ms       Mumbai - San Francisco over the public internet
    ===================  ==============  ===========  ====================================================

    Sources and reasoning:

    * Ethernet: line rates of IEEE 802.3ab (1000BASE-T) and 802.3ae (10GbE).
      The latencies are typical small-message costs of kernel TCP/IP over
      commodity NICs and switches (tens of microseconds, lower on 10GbE);
      they are assumptions, not a vendor figure: measure yours (e.g. with the
      OSU or ``nccl-tests`` latency benchmarks) if it matters.  They matter
      little for gradients: at 64 workers a ring all-reduce pays
      ``126 * 50 us = 6.3 ms`` of latency on 1 GbE.
    * InfiniBand: EDR and NDR 4x links (InfiniBand Trade Association roadmap;
      NVIDIA ConnectX-5 / ConnectX-7 product briefs quote 100 and 400 Gb/s per
      port, hardware latency below 1 us).  The 5 us per message is the order
      of NCCL's own cost model for one ring step over the network
      (``hwLat[NET]`` in ``src/graph/tuning.cc``: 2.7 us with its LL
      protocol, 9.6 us with the Simple protocol that large gradients use).
    * NVLink: H100 SXM, NVLink 4, 18 links, 900 GB/s per GPU counting both
      directions (NVIDIA H100 datasheet), so 450 GB/s each way.  3 us is
      NCCL's ``hwLat[NVLINK]`` for a ring step with the Simple protocol (3.4 us).
    * TPU DCN: Cloud TPU v5p documentation, "data center network (DCN)
      bandwidth per chip: 50 Gbps" (6.25e9 B/s, the figure the JAX scaling
      book, "How to Scale Your Model", uses).  DCN traffic goes through the
      hosts; the 25 us latency is an assumption of the same order as
      10-100 GbE TCP.  ICI (within a slice) is much faster and is not this preset.
    * WAN, Mumbai - San Francisco: 13,490 km great circle, so light needs
      45 ms in vacuum and 66 ms in fibre (refractive index 1.47) one way; real
      routes are longer (public ping tables such as WonderProxy's show
      intercontinental routes at about 1.6x the fibre bound, e.g. Sydney -
      Fremont 176-192 ms round trip over 11,950 km), hence about 110 ms one way
      (220 ms round trip).  The bandwidth is what one TCP flow gets over such a
      path: window / RTT, and with Linux's default maximum receive window of
      6 MiB (``net.ipv4.tcp_rmem``) that is about 6 MiB / 0.22 s = 230 Mbit/s
      before any loss (Mathis et al. 1997: loss cuts it further), and well
      below what the links carry; Hsieh et al. (Gaia, NSDI 2017) measured
      inter-region bandwidth between EC2 regions far below LAN speed.  We take
      100 Mbit/s per worker.  Several flows per worker can do better; pass your
      own ``Network`` if you measured it.
    """

    bandwidth: float
    latency: float = 0.0
    name: str = ""
    shared: bool = False
    call_latency: float = 0.0

    @classmethod
    def from_gbit(cls, gbit_per_s: float, latency_us: float = 0.0, name: str = "", shared: bool = False,
                  call_latency_us: float = 0.0) -> Network:
        """A network of ``gbit_per_s`` Gbit/s links and ``latency_us`` microseconds per message."""
        return cls(bandwidth=gbit_per_s * 1e9 / 8, latency=latency_us / 1e6, name=name, shared=shared,
                   call_latency=call_latency_us / 1e6)

    @classmethod
    def presets(cls) -> dict[str, Network]:
        """The preset networks by name (see the class docstring for the figures and their sources)."""
        return {n.name: n for n in _PRESETS}

    @property
    def label(self) -> str:
        """``name``, or the bandwidth in Gbit/s and the latency when there is none."""
        if self.name:
            return self.name
        return (f"{self.bandwidth * 8 / 1e9:g} Gbit/s, {self.latency * 1e6:g} us"
                + (f" + {self.call_latency * 1e6:g} us per call" if self.call_latency else "")
                + (", shared" if self.shared else ""))


_PRESETS = (
    Network(1e9 / 8, 50e-6, "ethernet_1g"),
    Network(10e9 / 8, 20e-6, "ethernet_10g"),
    Network(100e9 / 8, 5e-6, "infiniband_100g"),
    Network(400e9 / 8, 5e-6, "infiniband_400g"),
    Network(450e9, 3e-6, "nvlink"),
    Network(50e9 / 8, 25e-6, "tpu_dcn"),
    Network(100e6 / 8, 110e-3, "wan"),
)
for _net in _PRESETS:
    setattr(Network, _net.name, _net)
del _net


def _check(nbytes, workers, net):
    check_range("nbytes", nbytes, 0, None)
    check_range("workers", workers, 1, None, integer=True)
    _check_network(net)


def _call(net: Network, messages: int, bytes_time: float) -> float:
    """One collective call: ``messages`` latencies in sequence + the longer of its call latency and its bytes' time."""
    return messages * net.latency + max(net.call_latency, bytes_time)


def allreduce_time(nbytes: float, workers: int, net: Network) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` bytes per worker over ``workers`` workers.

    ``2 (n-1) latency + 2 (n-1)/n * nbytes / bandwidth``; on a shared medium
    (``net.shared``) the bytes of all ``n`` links cross one:
    ``2 (n-1) latency + 2 (n-1) * nbytes / bandwidth``.  With a
    ``call_latency``, the bytes' term becomes ``max(call_latency, bytes' time)``
    (see :class:`Network`).

    Raises:
      ValueError: negative ``nbytes``, ``workers < 1``, ``bandwidth <= 0``,
        ``latency < 0`` or ``call_latency < 0``.
    """
    _check(nbytes, workers, net)
    n = int(workers)
    if n == 1:
        return 0.0
    links = 1 if net.shared else n
    return _call(net, 2 * (n - 1), 2 * (n - 1) / links * nbytes / net.bandwidth)


def allgather_time(nbytes: float, workers: int, net: Network) -> float:
    """Seconds of a ring all-gather where each worker contributes ``nbytes`` bytes.

    ``(n-1) latency + (n-1) * nbytes / bandwidth``; on a shared medium
    ``(n-1) latency + n (n-1) * nbytes / bandwidth``; with a ``call_latency``,
    as :func:`allreduce_time`.

    Raises:
      ValueError: as :func:`allreduce_time`.
    """
    _check(nbytes, workers, net)
    n = int(workers)
    if n == 1:
        return 0.0
    links = 1 if net.shared else n
    return _call(net, n - 1, n * (n - 1) / links * nbytes / net.bandwidth)


def parameter_server_time(nbytes: float, workers: int, net: Network, result_bytes: float | None = None) -> float:
    """Seconds of a push/pull through one parameter server whose link is shared by all workers.

    ``2 latency + n (nbytes + result_bytes) / bandwidth``, shared medium or not
    (the server's link carries every push and pull either way); with a
    ``call_latency``, as :func:`allreduce_time`.

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
    return _call(net, 2, n * (nbytes + out) / net.bandwidth)


_TIMES = {"all-reduce": allreduce_time, "all-gather": allgather_time, "parameter-server": parameter_server_time}

#: Bytes per element of the dtypes of audited collectives (HLO type names, as :class:`compjax.accounting.Collective`
#: records them).
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                 "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def collective_time(kind: str, nbytes: float, workers: int, net: Network, framing: Framing | None = None,
                    element_bytes: int = 4) -> float:
    """Seconds of one collective of ``kind`` (``"all-reduce"``, ``"all-gather"``, ``"parameter-server"``).

    Without ``framing``: the formulas of :func:`allreduce_time`,
    :func:`allgather_time`, :func:`parameter_server_time` over the payload
    bytes.  With a :class:`Framing`: the same latencies, and the bytes' time
    scaled by ``wire_bytes(kind, nbytes, n, framing) / wire_bytes(kind, nbytes,
    n, Framing.none)``: every message also carries its headers, notifications
    and acknowledgements (gloo's messages, :func:`gloo_messages`), which dominate
    small collectives (a 4-byte all-reduce puts about 2.5 kB on the wire at
    n = 4); a call that sends nothing costs nothing.

    Args:
      kind: the collective.
      nbytes: bytes one worker puts in (an integer with ``framing``).
      workers: n.
      net: the :class:`Network`.
      framing: None (payload bytes only) or a :class:`Framing`, e.g. ``Framing.gloo_tcp``.
      element_bytes: bytes per element (gloo cuts an all-reduce at whole elements).

    Raises:
      ValueError: an unknown ``kind``, or bad numbers as :func:`allreduce_time`.

    Examples:
      >>> from compjax import netmodel
      >>> net = netmodel.Network(12.5e6, 1e-4, shared=True)   # 100 Mbit/s shared by all, 0.1 ms per message
      >>> round(netmodel.collective_time("all-reduce", 827_688, 2, net), 4)   # 2 messages' latency + 2 * b / B
      0.1326
      >>> round(netmodel.collective_time("all-reduce", 827_688, 2, net, netmodel.Framing.gloo_tcp), 4)
      0.1389
      >>> host = netmodel.Network(12.5e6, shared=True, call_latency=0.002)   # 2 ms per call, no per-message cost
      >>> netmodel.collective_time("all-reduce", 4, 2, host, netmodel.Framing.gloo_tcp)   # 758 bytes: 61 us < 2 ms
      0.002
    """
    if kind not in _TIMES:
        raise ValueError(f"kind must be one of {sorted(_TIMES)}, got {kind!r}")
    if framing is None or int(workers) == 1:
        return _TIMES[kind](nbytes, workers, net)
    payload = wire_bytes(kind, nbytes, workers, Framing.none, element_bytes)
    if payload == 0:
        return 0.0
    messages = _TIMES[kind](0, workers, Network(math.inf, 1.0))  # latencies in sequence
    bytes_time = _TIMES[kind](nbytes, workers, Network(net.bandwidth, shared=net.shared))
    return _call(net, messages, bytes_time * wire_bytes(kind, nbytes, workers, framing, element_bytes) / payload)


def _calls(c) -> list[tuple[int, int]]:
    """``(bytes, element bytes)`` of each gloo call of an audited collective: one per operand."""
    operands = getattr(c, "operands", ()) or ()
    if not operands:
        return [(int(c.bytes), 4)]
    calls = []
    for dtype, shape in operands:
        if dtype not in ELEMENT_BYTES:
            raise ValueError(f"dtype must be one of {sorted(ELEMENT_BYTES)}, got {dtype!r}")
        calls.append((math.prod(shape) * ELEMENT_BYTES[dtype], ELEMENT_BYTES[dtype]))
    return calls


def step_time(collectives: Iterable, workers: int, net: Network, framing: Framing | None = None) -> float:
    """Seconds of communication of a step, from :func:`compjax.audit_collectives` records.

    Each record's ``op`` picks the model and its ``bytes`` (what one worker
    contributes) the size; collectives are taken to run one after another.
    With a ``framing``, each operand of a record is a collective call of its
    own (XLA:CPU issues one gloo call per operand of a combined collective),
    timed by :func:`collective_time` with that framing.

    Raises:
      ValueError: a record whose ``op`` has no model here, or (with
        ``framing``) an operand dtype of unknown size.
    """
    if framing is None:
        return sum(collective_time(c.op, c.bytes, workers, net) for c in collectives)
    return sum(collective_time(c.op, b, workers, net, framing, eb) for c in collectives for b, eb in _calls(c))


class Framing(NamedTuple):
    """How a transport frames a collective's messages on the wire (all sizes in bytes).

    A message of ``m`` payload bytes costs on the wire::

        m + data_header + ceil((m + data_header) / segment_payload) * segment_header
          + control_messages * (control_bytes + segment_header) + acks * segment_header

    Attributes:
      segment_payload: payload bytes per link-level segment (TCP's MSS).
      segment_header: header bytes per segment as the link counts them.
      data_header: the transport's header carried with each data message.
      control_messages: small messages exchanged per data message (handshakes).
      control_bytes: payload bytes of each control message.
      acks: payload-free segments (TCP acknowledgements) per data message.
      name: a label.

    ``Framing.gloo_tcp`` (gloo's TCP transport over Ethernet-framed TCP/IPv4,
    MTU 1500):

    * ``segment_payload = 1448``: MTU 1500 - 20 (IPv4) - 32 (TCP header with
      the timestamp option Linux enables by default);
    * ``segment_header = 66``: 14 (Ethernet) + 20 + 32, what ``tc`` counts per
      segment (the kernel counts a segmentation-offloaded packet as its
      segments: ``qdisc_pkt_len_init``);
    * ``data_header = 48``, ``control_messages = 2``, ``control_bytes = 48``:
      gloo's TCP pair (``gloo/transport/tcp/pair.{h,cc}``) sends every
      unbound-buffer message as a rendezvous: the sender's
      ``NOTIFY_SEND_READY``, the receiver's ``NOTIFY_RECV_READY``, then the data
      op; each op opens with a preamble of six ``size_t`` (48 bytes) and the two
      notifications travel as segments of their own.

    * ``acks = 0.5``: calibrated, not derived: beyond the data and notification
      segments the kernel counted from 0 (2 processes on an idle host: the peer's
      own messages carry the acknowledgements) to about 1.8 segments per message
      (a loaded host: the receiver acknowledges each message on its own); 0.5
      keeps both within 10%.  Bulk
      transfers get more acknowledgements than that (one per 3-6 segments at
      10-100 Mbit/s, fewer unshaped); they are not modelled, and add 1-2% to a
      dense all-reduce's bytes.

    Measured against the kernel's count (``tc -s qdisc`` on a loopback shaped
    to 10 Mbit/s - 1 Gbit/s and unshaped, 2 and 4 processes:
    ``experiments/benchmarks/link.py``, results in
    ``experiments/results/benchmarks/link.md``).  ``Framing.none`` counts
    payload bytes only.
    """

    segment_payload: float
    segment_header: int = 0
    data_header: int = 0
    control_messages: int = 0
    control_bytes: int = 0
    acks: float = 0
    name: str = ""

    def message_bytes(self, payload: int) -> int:
        """Wire bytes of one message of ``payload`` bytes (see the class docstring)."""
        data = payload + self.data_header
        segments = math.ceil(data / self.segment_payload) if data else 0
        return int(data + segments * self.segment_header
                   + self.control_messages * (self.control_bytes + self.segment_header)
                   + self.acks * self.segment_header)


Framing.gloo_tcp = Framing(1448, 66, 48, 2, 48, 0.5, "gloo_tcp")
Framing.none = Framing(math.inf, name="none")

#: gloo's largest all-reduce segment (``AllreduceOptionsImpl::kMaxSegmentSize``, ``gloo/allreduce.h``).
GLOO_MAX_SEGMENT = 1024 * 1024


def _ring_allreduce_messages(nbytes: int, workers: int, element_bytes: int) -> list[int]:
    """Message sizes of gloo's ring all-reduce (``gloo/allreduce.cc``, ``ring``), every rank together.

    The buffer is cut into ``numSegments`` segments (at least ``2 n``, a multiple
    of ``n``, at most 1 MiB each, whole elements); reduce-scatter and all-gather
    each send ``(n-1) numSegments / n`` segments per rank, skipping those past
    the end of the buffer.
    """
    n = workers
    seg_max = element_bytes * max(1, GLOO_MAX_SEGMENT // element_bytes)
    num = max(-(-nbytes // seg_max), 2 * n)
    num = -(-num // n) * n
    per_rank = num // n
    seg = -(-nbytes // num)  # ceil(nbytes / num) rounded up to whole elements
    seg = -(-seg // element_bytes) * element_bytes
    sizes = []
    for rank in range(n):
        for first in ((rank + 1) * per_rank, rank * per_rank):  # reduce-scatter, then all-gather
            for i in range(num - per_rank):
                offset = ((first + i) * seg) % (num * seg)
                length = min(seg, nbytes - offset)
                if length > 0:
                    sizes.append(length)
    return sizes


def gloo_messages(kind: str, nbytes: int, workers: int, element_bytes: int = 4) -> list[int]:
    """Payload sizes (bytes) of the messages one collective sends, all workers together, as gloo runs it.

    * ``"all-reduce"``: gloo's ring (reduce-scatter then all-gather over
      ``>= 2 n`` segments of at most 1 MiB); ``2 (n-1) nbytes`` bytes in all.
    * ``"all-gather"``: gloo's ring (``gloo/allgather.cc``): each worker sends
      ``n - 1`` blocks of ``nbytes``, each as two halves; ``n (n-1) nbytes``.
    * ``"parameter-server"``: each worker pushes ``nbytes`` and pulls ``nbytes``.

    Args:
      kind: the collective.
      nbytes: bytes one worker puts in (one operand: XLA issues one gloo call
        per operand of a combined collective).
      workers: n.
      element_bytes: bytes per element (the all-reduce cuts at whole elements).

    Raises:
      ValueError: an unknown ``kind``, negative ``nbytes``, ``workers < 1`` or
        ``element_bytes < 1``.
    """
    check_range("nbytes", nbytes, 0, None, integer=True)
    check_range("workers", workers, 1, None, integer=True)
    check_range("element_bytes", element_bytes, 1, None, integer=True)
    n, b = int(workers), int(nbytes)
    if n == 1 or b == 0:
        return []
    if kind == "all-reduce":
        return _ring_allreduce_messages(b, n, int(element_bytes))
    if kind == "all-gather":
        return [b // 2, b - b // 2] * (n * (n - 1))
    if kind == "parameter-server":
        return [b] * (2 * n)
    raise ValueError(f"kind must be one of {sorted(_TIMES)}, got {kind!r}")


def wire_bytes(kind: str, nbytes: int, workers: int, framing: Framing | None = None,
               element_bytes: int = 4) -> int:
    """Bytes one collective puts on the links, all workers together, framing included.

    ``sum(framing.message_bytes(m) for m in gloo_messages(kind, nbytes, workers,
    element_bytes))``; with ``Framing.none``, the payload traffic alone
    (``2 (n-1) nbytes`` for an all-reduce, ``n (n-1) nbytes`` for an all-gather).

    Args:
      kind, nbytes, workers, element_bytes: as :func:`gloo_messages`.
      framing: a :class:`Framing` (default ``Framing.gloo_tcp``).

    Raises:
      ValueError: as :func:`gloo_messages`.

    Examples:
      >>> from compjax import netmodel
      >>> netmodel.wire_bytes("all-reduce", 827_688, 2, netmodel.Framing.none)
      1655376
      >>> netmodel.wire_bytes("all-reduce", 827_688, 2)   # + 8 messages' framing
      1733352
    """
    framing = Framing.gloo_tcp if framing is None else framing
    return sum(framing.message_bytes(m) for m in gloo_messages(kind, nbytes, workers, element_bytes))


class StepPrediction(NamedTuple):
    """Modelled time of one training step (seconds), from :func:`predict_step`.

    Attributes:
      compute_s: the compute time given (forward, backward, optimizer).
      comm_s: the communication time of the step's collectives, one after another.
      no_overlap_s: ``compute_s + comm_s`` (communication starts after the backward pass).
      overlap_s: ``max(compute_s, comm_s)`` (communication perfectly hidden behind compute).
      comm_fraction: ``comm_s / no_overlap_s`` (0 when both are 0).
      hiding_bandwidth: the link bandwidth (bytes/s) at which ``comm_s`` equals
        ``compute_s``, latency kept: above it communication is no longer the
        bottleneck under perfect overlap.  ``inf`` when the latency alone
        already takes ``compute_s`` or more; 0 when there is nothing to send.
    """

    compute_s: float
    comm_s: float
    no_overlap_s: float
    overlap_s: float
    comm_fraction: float
    hiding_bandwidth: float


def _check_network(net: Network) -> None:
    check_range("bandwidth", net.bandwidth, 0, None, lo_open=True)
    check_range("latency", net.latency, 0, None)
    check_range("call_latency", net.call_latency, 0, None)


def predict_step(collectives: Iterable, workers: int, network: Network, compute_s: float,
                 framing: Framing | None = None) -> StepPrediction:
    """Compute + communication time of one data-parallel step over ``network``.

    Args:
      collectives: the step's collectives, e.g. ``cj.audit_collectives(step, ...)``
        (anything with ``.op`` in ``"all-reduce"``, ``"all-gather"``,
        ``"parameter-server"`` and ``.bytes``, what one worker puts in).
      workers: number of workers n (the audit may come from a smaller mesh:
        compjax's per-worker bytes do not depend on n).
      network: the :class:`Network`.
      compute_s: seconds of computation per step (e.g. :func:`measure_compute_time`).
      framing: None (payload bytes) or a :class:`Framing` (wire bytes, each
        operand a call of its own: :func:`step_time`).

    Returns:
      A :class:`StepPrediction`.  ``hiding_bandwidth`` solves
      ``comm(B) = compute_s`` for ``B``: ``latency_part + bytes_part / B``
      without a ``call_latency`` (every formula here is then linear in
      ``1 / B``), by bisection with one (each call ``max(call_latency, bytes /
      B)``).

    Raises:
      ValueError: ``bandwidth <= 0``, ``latency < 0``, ``compute_s < 0``,
        ``workers < 1``, a record whose ``op`` has no model, or (with
        ``framing``) an operand dtype of unknown size.
    """
    check_range("workers", workers, 1, None, integer=True)
    _check_network(network)
    check_range("compute_s", compute_s, 0, None)
    collectives = list(collectives)
    compute_s = float(compute_s)
    comm = step_time(collectives, workers, network, framing)
    # comm(B) = alpha_part + beta_part / B
    alpha_part = step_time(collectives, workers, network._replace(bandwidth=math.inf), framing)
    beta_part = step_time(collectives, workers, network._replace(bandwidth=1.0, latency=0.0, call_latency=0.0),
                          framing)
    if beta_part == 0:
        hiding = 0.0
    elif alpha_part >= compute_s:
        hiding = math.inf
    elif network.call_latency == 0:
        hiding = beta_part / (compute_s - alpha_part)
    else:  # each call max(call_latency, bytes / B): comm(B) falls from inf to alpha_part; bisect between the
        # bandwidths at which the bytes alone (lo) and the bytes on top of every latency (hi) take compute_s
        messages = alpha_part - step_time(collectives, workers, network._replace(bandwidth=math.inf, latency=0.0),
                                          framing)
        lo, hi = beta_part / (compute_s - messages), beta_part / (compute_s - alpha_part)
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if step_time(collectives, workers, network._replace(bandwidth=mid),
                                            framing) > compute_s else (lo, mid)
        hiding = hi
    total = compute_s + comm
    return StepPrediction(compute_s, comm, total, max(compute_s, comm), comm / total if total > 0 else 0.0, hiding)


def measure_compute_time(fn: Callable, *args, repeats: int = 5, warmup: int = 1, **kwargs) -> float:
    """Median seconds of ``jax.block_until_ready(fn(*args, **kwargs))`` over ``repeats`` calls.

    ``warmup`` calls run first and are not timed (the first one compiles a
    jitted ``fn``).  Time a step without communication (one worker, or the
    single-device program) to get the ``compute_s`` of :func:`predict_step`.
    Note that ``fn`` is called ``warmup + repeats`` times: a step that donates
    its arguments needs fresh ones, so wrap it.

    Raises:
      ValueError: ``repeats < 1`` or ``warmup < 0``.
    """
    import jax  # the formulas above do not need JAX

    check_range("repeats", repeats, 1, None, integer=True)
    check_range("warmup", warmup, 0, None, integer=True)
    for _ in range(int(warmup)):
        jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(int(repeats)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _as_list(x, what: str) -> list:
    if isinstance(x, Network):
        return [x]
    if isinstance(x, Mapping):
        return [n if n.name else n._replace(name=str(k)) for k, n in x.items()]
    if isinstance(x, (str, bytes)) or not isinstance(x, Iterable):
        raise ValueError(  # noqa: TRY004 - bad input raises ValueError naming the parameter, as everywhere here
            f"{what} must be a Network, a sequence of Networks or a mapping name -> Network, got {x!r}")
    return list(x)


def compare(
    steps: Mapping[str, Iterable],
    workers: int | Sequence[int],
    networks: Network | Sequence[Network] | Mapping[str, Network],
    compute_s: float | Mapping[str, float],
    *,
    baseline: str | None = "identity",
) -> list[dict[str, Any]]:
    """Model every compressor's step on every network: what would each network gain from each compressor?

    Args:
      steps: compressor name -> that compressor's step collectives (e.g. from
        :func:`compjax.audit_collectives`).
      workers: n, or several (one row per value).
      networks: a :class:`Network`, several, or a mapping name -> Network.
      compute_s: seconds of compute per step, the same for all, or a mapping
        compressor name -> its own compute time (compression costs compute).
      baseline: the entry of ``steps`` the speedups are taken against (on the
        same network and n), or None for no speedups.

    Returns:
      One dict per (compressor, network, workers), in the order of ``steps``,
      then ``networks``, then ``workers``, with keys ``compressor``,
      ``network`` (its label), ``bandwidth``, ``latency``, ``workers``,
      ``bytes`` (per worker per step, summed over the collectives), the
      :class:`StepPrediction` fields, and (with a baseline) ``speedup`` =
      baseline ``no_overlap_s`` / this ``no_overlap_s`` and ``speedup_overlap``
      (the same with ``overlap_s``).

    Raises:
      ValueError: ``baseline`` not in ``steps``, ``compute_s`` lacking a
        compressor, or bad numbers as :func:`predict_step`.
    """
    steps = {k: list(v) for k, v in steps.items()}
    if baseline is not None and baseline not in steps:
        raise ValueError(f"baseline must be one of the compressors in steps {sorted(steps)} or None, got {baseline!r}")
    ns = [workers] if isinstance(workers, (int, float)) else list(workers)
    nets = _as_list(networks, "networks")
    if isinstance(compute_s, Mapping):
        missing = sorted(set(steps) - set(compute_s))
        if missing:
            raise ValueError(f"compute_s has no time for {missing}")
        comp = {k: compute_s[k] for k in steps}
    else:
        comp = dict.fromkeys(steps, compute_s)
    rows = []
    for name, ops in steps.items():
        for net in nets:
            for n in ns:
                p = predict_step(ops, n, net, comp[name])
                row = {"compressor": name, "network": net.label, "bandwidth": net.bandwidth, "latency": net.latency,
                       "workers": int(n), "bytes": int(sum(int(c.bytes) for c in ops)), **p._asdict()}
                if baseline is not None:
                    b = predict_step(steps[baseline], n, net, comp[baseline])
                    row["speedup"] = b.no_overlap_s / p.no_overlap_s if p.no_overlap_s > 0 else math.inf
                    row["speedup_overlap"] = b.overlap_s / p.overlap_s if p.overlap_s > 0 else math.inf
                rows.append(row)
    return rows


def _fmt_bytes(b: float) -> str:
    return f"{b:,.0f}"


def _fmt_bw(bps: float) -> str:
    if math.isinf(bps):
        return "∞"
    return f"{bps * 8 / 1e9:.3g}"


#: the columns :func:`to_markdown` writes, when the rows have them: key -> (header, formatter).
_COLUMNS = {
    "compressor": ("compressor", str),
    "network": ("network", str),
    "workers": ("workers", str),
    "bytes": ("bytes/step/worker", _fmt_bytes),
    "compute_s": ("compute (ms)", lambda s: f"{s * 1e3:.1f}"),
    "comm_s": ("comm (ms)", lambda s: f"{s * 1e3:.1f}"),
    "no_overlap_s": ("step, no overlap (ms)", lambda s: f"{s * 1e3:.1f}"),
    "overlap_s": ("step, overlap (ms)", lambda s: f"{s * 1e3:.1f}"),
    "comm_fraction": ("comm share", lambda f: f"{f:.0%}"),
    "hiding_bandwidth": ("hiding bandwidth (Gbit/s)", _fmt_bw),
    "speedup": ("speedup, no overlap", lambda x: f"{x:.2f}×"),
    "speedup_overlap": ("speedup, overlap", lambda x: f"{x:.2f}×"),
}


def to_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of :func:`compare` rows (the known columns the rows have, in a fixed order).

    Times in milliseconds, bandwidths in Gbit/s, bytes per worker per step.
    Returns an empty string for no rows.
    """
    if not rows:
        return ""
    keys = [k for k in _COLUMNS if all(k in r for r in rows)]
    lines = ["| " + " | ".join(_COLUMNS[k][0] for k in keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(_COLUMNS[k][1](r[k]) for k in keys) + " |")
    return "\n".join(lines) + "\n"
