"""The multi-process helpers that need no second process: the lost-peer watcher and the end of a run."""

import threading
import time

from experiments import distributed


def _watch_with_no_service(monkeypatch, finishing: bool) -> list[int]:
    """Run the watcher in this process, where no distributed service runs (its poll fails as if the
    coordinator were gone); return the exit codes it asked for within half a second."""
    exits: list[int] = []
    event = threading.Event()
    if finishing:
        event.set()
    monkeypatch.setattr(distributed, "_finishing", event)
    monkeypatch.setattr(distributed.os, "_exit", exits.append)
    thread = distributed.watch(interval=0.01)
    deadline = time.time() + 0.5
    while time.time() < deadline and not exits and thread.is_alive():
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
