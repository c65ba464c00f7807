"""Multi-process runs for the main job: ``jax.distributed`` set-up and lost-peer detection.

The engine is JAX's own: :func:`initialize` calls ``jax.distributed.initialize``
(coordinator address, process count and id from the arguments, or from the
environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``, as :mod:`experiments.launch` sets them; with none of them,
JAX's own cluster detection, e.g. SLURM or Cloud TPU).  On CPU, the
processes' collectives go through gloo over TCP, so several processes on one
machine (or several machines) exchange real bytes.

A lost peer: JAX's distributed service sees a process that stops sending
heartbeats within ``heartbeat_timeout`` seconds.  The service runs in
recoverable mode here, so it does not abort the survivors itself; instead
:func:`watch` (a daemon thread) and :func:`exit_lost_peer` (called when a
collective fails) ask it which processes are alive, print one line naming the
lost ones and end the process with exit code :data:`LOST_PEER_EXIT`.  If the
lost process is the coordinator (process 0), the survivors lose the service
itself and JAX ends them ("the JAX distributed service detected fatal
errors"), still with a non-zero exit code.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

#: Exit code of a process that lost a peer.
LOST_PEER_EXIT = 75


def settings(coordinator_address: str | None, num_processes: int | None, process_id: int | None):
    """The (address, count, id) to use: the arguments, else the ``JAX_*`` environment variables."""
    env = os.environ
    address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    count = num_processes if num_processes is not None else (
        int(env["JAX_NUM_PROCESSES"]) if "JAX_NUM_PROCESSES" in env else None)
    pid = process_id if process_id is not None else (int(env["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in env else None)
    return address, count, pid


def initialize(coordinator_address: str | None, num_processes: int | None, process_id: int | None, *,
               heartbeat_timeout: int = 20) -> None:
    """Join the multi-process run: gloo collectives on CPU, then ``jax.distributed.initialize``.

    Must run before any JAX computation.  ``heartbeat_timeout`` (seconds, >= 2)
    bounds how long a lost process goes unnoticed.

    Raises:
      ValueError: ``heartbeat_timeout`` < 2, or a process id outside
        ``[0, num_processes)``.
    """
    if heartbeat_timeout < 2:
        raise ValueError(f"heartbeat_timeout must be >= 2 seconds, got {heartbeat_timeout}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} must be in [0, {num_processes}) (the processes)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)  # survivors report a lost peer themselves
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=int(heartbeat_timeout))


#: Set by :func:`finish`: the run is over, the watcher stops (the service it polls is being shut down).
_finishing = threading.Event()
#: The watcher threads started by :func:`watch`: :func:`finish` waits for them before the service goes.
_watchers: list[threading.Thread] = []


def _client():
    from jax._src import distributed  # the client JAX's initialize created; no public accessor in JAX 0.10

    return distributed.global_state.client


def lost_peers() -> list[int]:
    """The processes the distributed service no longer hears from (may block up to the heartbeat timeout).

    Raises:
      RuntimeError: the coordinator (process 0, which hosts the service) cannot be reached.
    """
    everyone = list(range(jax.process_count()))
    try:
        live = _client().get_live_nodes(everyone)
    except Exception as e:  # the service itself is gone
        raise RuntimeError(f"the coordinator (process 0) cannot be reached: {e}") from e
    return [p for p in everyone if p not in live]


def exit_lost_peer(reason: str = "", resume_hint: str = "") -> None:
    """If a peer is lost: print one line naming it and end this process with :data:`LOST_PEER_EXIT`.

    Called when a step fails (it blocks up to the heartbeat timeout to find
    out); returns if every process still answers, so that the caller re-raises
    the error.  Ends the process without running exit handlers (JAX's
    shutdown barrier would wait for the lost peer).
    """
    me = jax.process_index()
    try:
        lost = lost_peers()
        if not lost:
            return
        who = f"lost peer: process {', '.join(map(str, lost))} of {jax.process_count()} stopped responding"
    except RuntimeError as e:
        who = f"lost peer: {e}"
    tail = f" ({reason.splitlines()[0][:200]})" if reason else ""
    print(f"[process {me}] {who}; exiting{tail}. {resume_hint}".rstrip(), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(LOST_PEER_EXIT)


def finish(timeout: float = 60.0) -> None:
    """End this process's part of the run cleanly (every process calls it at the end).

    All processes meet at a barrier; then the others disconnect from the
    distributed service and process 0, which hosts it, waits (up to
    ``timeout`` seconds) until they have before stopping it, so that no process
    finds the service gone while it says goodbye.
    """
    from jax.experimental import multihost_utils

    _finishing.set()  # before the service goes: the watcher must not report its shutdown as a lost coordinator
    for thread in _watchers:  # nor be inside a call to the service when it goes (a C++ abort at exit)
        thread.join(timeout)
    multihost_utils.sync_global_devices("compjax-finish")
    if jax.process_index() == 0:
        client, deadline = _client(), time.time() + timeout
        while time.time() < deadline and len(client.get_live_nodes(list(range(jax.process_count())))) > 1:
            time.sleep(0.1)
    jax.distributed.shutdown()


def watch(resume_hint: str = "", interval: float = 2.0) -> threading.Thread:
    """Start a daemon thread that exits the process (see :func:`exit_lost_peer`) once a peer is lost.

    Catches a lost peer while this process is not inside a collective (e.g.
    evaluating or saving); a failing collective is reported by the caller.
    The thread returns once :func:`finish` has begun (the service it polls is
    then shut down on purpose), and :func:`finish` waits for it.
    """

    def run():
        while not _finishing.wait(interval):
            try:
                lost = lost_peers()
            except RuntimeError:
                lost = [0]
            if lost and not _finishing.is_set():
                exit_lost_peer("", resume_hint)

    thread = threading.Thread(target=run, name="lost-peer-watch", daemon=True)
    thread.start()
    _watchers.append(thread)
    return thread
