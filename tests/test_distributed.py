"""The multi-process helpers that need no second process: the lost-peer watcher and the end of a run."""

import threading
import time

from experiments import distributed


def _watch_with_no_service(monkeypatch, finishing: bool) -> list[int]:
    """Run the watcher in this process, where no distributed service runs (its poll fails as if the
    coordinator were gone); return the exit codes it asked for before its thread ended (or 30 s passed: a
    limit for a loaded machine only, the wait ends at the first exit asked for)."""
    exits: list[int] = []
    event = threading.Event()
    if finishing:
        event.set()
    monkeypatch.setattr(distributed, "_finishing", event)
    monkeypatch.setattr(distributed.os, "_exit", exits.append)
    thread = distributed.watch(interval=0.01)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not exits and thread.is_alive():
        time.sleep(0.01)
    event.set()  # stop the thread either way
    thread.join(1.0)
    return exits


def test_watcher_reports_a_lost_coordinator(monkeypatch, capsys):
    assert _watch_with_no_service(monkeypatch, finishing=False)[:1] == [distributed.LOST_PEER_EXIT]
    assert "lost peer: the coordinator (process 0) cannot be reached" in capsys.readouterr().err


def test_watcher_stops_once_the_run_finishes(monkeypatch):
    """finish() shuts the service down on purpose: the watcher must not end a completed run with exit 75
    (seen in CI: the restarted run printed its summary, then exited 75)."""
    assert _watch_with_no_service(monkeypatch, finishing=True) == []


def test_finish_waits_for_the_watcher_before_the_service_goes(monkeypatch):
    """A watcher caught inside a call to the service when the service shuts down aborts the process at exit
    (seen in the suite: 'FATAL: exception not rethrown', exit -6, after a completed run): finish() joins it."""
    from jax.experimental import multihost_utils

    monkeypatch.setattr(distributed, "_finishing", threading.Event())
    monkeypatch.setattr(distributed, "_watchers", [])
    monkeypatch.setattr(distributed.os, "_exit", lambda code: None)

    def slow_poll():  # a poll in flight: the service answers late, then is gone
        time.sleep(0.3)
        raise RuntimeError("gone")

    monkeypatch.setattr(distributed, "lost_peers", slow_poll)
    alive_at_shutdown = []
    monkeypatch.setattr(multihost_utils, "sync_global_devices", lambda name: None)
    monkeypatch.setattr(distributed.jax, "process_index", lambda: 1)
    monkeypatch.setattr(distributed.jax.distributed, "shutdown",
                        lambda: alive_at_shutdown.append(any(t.is_alive() for t in distributed._watchers)))
    distributed.watch(interval=0.01)
    time.sleep(0.05)  # the first poll is in flight
    distributed.finish()
    assert alive_at_shutdown == [False]
