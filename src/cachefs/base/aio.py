"""The single event-loop thread that the sync facades (fsspec, CLI, FUSE handlers) run the async core on.

One loop per process, started on first use and stopped at interpreter exit; a forked child starts its own. Sync
callers use :func:`run_sync` (and wait) or :func:`run_soon` (and go on); code already on the loop must await instead
(calling ``run_sync`` from the loop thread would deadlock, so it raises).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["get_loop", "run_apart", "run_soon", "run_sync", "single_flight", "stop_on_signals"]

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """The process-wide cachefs event loop (started lazily in a daemon thread)."""
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="cachefs-io", daemon=True)
            thread.start()
            _loop, _thread = loop, thread
            atexit.register(_stop)
        return _loop


def _forget_loop_in_child() -> None:
    # A forked child (a DataLoader worker) has no copy of the loop's thread: the loop it inherited would never
    # run what it is given. The child starts its own on first use.
    global _lock, _loop, _thread
    _lock, _loop, _thread = threading.Lock(), None, None


os.register_at_fork(after_in_child=_forget_loop_in_child)


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the cachefs loop and wait for its result from a plain thread."""
    loop = get_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("run_sync called from the cachefs event-loop thread; await instead")
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result(timeout)
    except BaseException:
        fut.cancel()
        raise


def run_soon(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start ``coro`` on the cachefs loop from any thread and go on without waiting for it; its future."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop())


async def run_apart(make: Callable[[], Coroutine[Any, Any, T]], name: str = "cachefs-apart") -> T:
    """Run ``make()`` on an event loop of its own in a daemon thread, and await its result here. CPU-heavy async
    work (a long listing: pages parsed, entries written) then interleaves with this loop's requests at the GIL's
    pace rather than in whole callbacks that every request queues behind. Cancelling the caller cancels it; at
    interpreter exit it is left (a daemon thread)."""
    caller = asyncio.get_running_loop()
    done: asyncio.Future = caller.create_future()
    started = threading.Event()
    own: dict[str, Any] = {}

    def report(outcome: BaseException | None, value: Any = None) -> None:
        if done.done():
            return
        if outcome is None:
            done.set_result(value)
        else:
            done.set_exception(outcome)

    def main() -> None:
        loop = asyncio.new_event_loop()
        own["task"] = task = loop.create_task(make())
        own["loop"] = loop
        started.set()
        try:
            value = loop.run_until_complete(task)
            caller.call_soon_threadsafe(report, None, value)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            if not caller.is_closed():
                caller.call_soon_threadsafe(report, exc)
        finally:
            loop.close()

    threading.Thread(target=main, name=name, daemon=True).start()
    try:
        return await done
    except asyncio.CancelledError:
        started.wait()  # (set as the thread starts: at most a moment)
        with contextlib.suppress(RuntimeError):  # (its loop is closed: it had ended)
            own["loop"].call_soon_threadsafe(own["task"].cancel)
        raise


def stop_on_signals() -> asyncio.Event:
    """An event the running loop sets on SIGTERM or SIGINT (replacing the handlers set before)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def single_flight(table: dict, key, coro) -> asyncio.Future:
    """Run ``coro`` as ``table[key]`` until it finishes (then the entry goes; its outcome is marked seen, the
    awaiters get any exception themselves). Call from the loop."""
    fut = asyncio.ensure_future(coro)
    table[key] = fut
    fut.add_done_callback(lambda f: (table.pop(key, None), f.cancelled() or f.exception()))
    return fut


def _stop() -> None:
    global _loop
    loop = _loop
    if loop is None or loop.is_closed():
        return
    loop.call_soon_threadsafe(loop.stop)
    if _thread is not None:
        _thread.join(timeout=5)
