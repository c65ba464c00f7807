"""How contributions reach the syncer and replies reach the learners.

:class:`Transport` is the interface the learner and the syncer are written against; a transport
moves messages and never looks into them.  A contribution arrives in two parts, an
:class:`Incoming`: its :class:`~compjax.decoupled.Header` first, then, only if the syncer asks,
its arrays (``pull``).  The syncer checks the header (sender, fragment, staleness, the declared
shapes, dtypes and size) before it pulls, so a transport between processes allocates the
receive buffers only for a contribution already known to fit.

:class:`InProcessTransport` runs learners and the syncer as threads of one process, over
``queue.Queue``: the fast tests use it, with the same learner and syncer code.
"""

from __future__ import annotations

import abc
import dataclasses
import queue
import threading
from collections.abc import Callable

from compjax.decoupled.messages import Contribution, Header, Reply


@dataclasses.dataclass(frozen=True)
class Incoming:
    """A contribution as the syncer receives it: the header now, the arrays on demand.

    Attributes:
      header: the contribution's :class:`~compjax.decoupled.Header`.
      pull: a callable that receives the arrays and returns them (a tuple of NumPy arrays,
        nominally of the header's shapes and dtypes; the syncer checks them again).  Called at
        most once, and only for a header the syncer admitted.
    """

    header: Header
    pull: Callable[[], tuple]


class Transport(abc.ABC):
    """What a learner and the syncer need of the network; one instance serves both sides.

    Learner side: :meth:`send` (called from the learner's background sender thread) and
    :meth:`poll`.  Syncer side: :meth:`receive` and :meth:`reply`.  Every method is safe to
    call from any thread.
    """

    def attach(self, syncer) -> None:
        """Called by :meth:`Syncer.serve <compjax.decoupled.Syncer.serve>` with the syncer it serves.

        A transport that handles membership itself (joins: ``syncer.register(name)``; liveness:
        ``syncer.heartbeat(name)``) keeps it; the default ignores it.
        """

    @abc.abstractmethod
    def send(self, contribution: Contribution) -> None:
        """Deliver ``contribution`` to the syncer (may block while the bytes move)."""

    @abc.abstractmethod
    def poll(self, learner: str, timeout: float | None = 0.0) -> Reply | None:
        """The next reply for ``learner``, waiting up to ``timeout`` seconds (None: forever); None if none came."""

    @abc.abstractmethod
    def receive(self, timeout: float | None = 0.0) -> Incoming | None:
        """The next contribution's header (and its ``pull``), waiting up to ``timeout`` seconds; None if none came."""

    @abc.abstractmethod
    def reply(self, reply: Reply) -> None:
        """Deliver ``reply`` to ``reply.learner`` (dropped if that learner is not connected)."""

    def abandon(self, learner: str, fragment: int) -> None:
        """Learner side: ``learner`` gave up waiting for the reply to its send of ``fragment`` (the syncer is
        down); a transport that holds the send's arrays for the syncer lets them go.  The default does nothing."""


class InProcessTransport(Transport):
    """Learners and syncer as threads of one process: one queue to the syncer, one per learner.

    Args:
      learners: the names of the learners that may receive replies.

    Attributes:
      pulls: how many contributions' arrays the syncer pulled (a refused header is never pulled).

    Examples:
      >>> t = InProcessTransport(["a"])
      >>> t.poll("a") is None and t.receive() is None
      True
    """

    def __init__(self, learners):
        self._inbox: queue.Queue = queue.Queue()
        self._outboxes = {str(name): queue.Queue() for name in learners}
        self._lock = threading.Lock()
        self.pulls = 0

    def send(self, contribution: Contribution) -> None:
        self._inbox.put(contribution)

    def poll(self, learner: str, timeout: float | None = 0.0) -> Reply | None:
        box = self._outboxes[learner]
        try:
            return box.get(block=timeout is None or timeout > 0, timeout=timeout)
        except queue.Empty:
            return None

    def receive(self, timeout: float | None = 0.0) -> Incoming | None:
        try:
            c = self._inbox.get(block=timeout is None or timeout > 0, timeout=timeout)
        except queue.Empty:
            return None

        def pull(values=c.values):
            with self._lock:
                self.pulls += 1
            return values

        return Incoming(c.header, pull)

    def reply(self, reply: Reply) -> None:
        box = self._outboxes.get(reply.learner)
        if box is not None:
            box.put(reply)
