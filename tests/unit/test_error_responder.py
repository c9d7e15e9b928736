"""The mount holder's error responder: a start that races a stop never leaves a thread nobody can stop."""

from __future__ import annotations

import os
import threading

from cachefs.fuse.error_responder import ErrorResponder


def test_a_start_during_a_stop_leaves_no_thread_running_unstopped(monkeypatch):
    rfd, wfd = os.pipe()  # (never readable: the responder only polls it)
    responder = ErrorResponder(rfd)
    responder.start()
    real_join = threading.Thread.join
    raced, hung = [], []

    def join_after_a_racing_start(self, timeout=None):
        if not raced:  # the holder's main thread starts answering again between stop's signal and its join
            raced.append(True)
            responder.start()
        real_join(self, 3.0 if timeout is None else timeout)
        if self.is_alive():
            hung.append(self)  # (stop() would have waited for ever)

    monkeypatch.setattr(threading.Thread, "join", join_after_a_racing_start)
    try:
        responder.stop()
        assert not hung, "stop() waited for a thread the racing start had un-stopped"
        responder.stop()  # the one the racing start made
        monkeypatch.setattr(threading.Thread, "join", real_join)
        alive = [t for t in threading.enumerate() if t.name == "cachefs-fuse-fallback" and t.is_alive()]
        for t in alive:
            t.join(1.0)
        assert not [t for t in alive if t.is_alive()]
    finally:
        os.close(rfd)
        os.close(wfd)
