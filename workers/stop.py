"""StopFlag: a graceful stop on the first SIGTERM / SIGINT, a hard stop on the second.

Both daemons check it between units of work (a generator batch, a trainer step):

    with StopFlag() as stop:          # installs the handlers; puts the previous ones back on exit
        while not stop:
            ...                       # one unit of work
            stop.wait(poll_seconds)   # a sleep that a signal (or stop.set()) cuts short

First signal: the flag is set and logged; the daemon finishes what it is doing
(flush, checkpoint) and exits 0. Second signal: the handlers that were there
before are put back and the signal raised again, so it does what it would have
done without us (SIGINT: KeyboardInterrupt; SIGTERM: the process ends at once).
Handlers can only be installed from the main thread; elsewhere the flag is
only set by callers (`set()`).

Waiting is on a `queue.SimpleQueue`, not a `threading.Event`: the handler runs
in the main thread between two bytecodes, possibly inside `Event.wait` while
it holds the Event's (non-reentrant) lock, and `Event.set()` would then wait on
that lock for ever. `SimpleQueue.put` is reentrant, so the handler may call it.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading

log = logging.getLogger("asyncgrpo.stop")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopFlag:
    """A stop request: set by the first SIGTERM / SIGINT or by `set()`; falsy until then."""

    def __init__(self, install_signals: bool = True):
        self._requested = False
        self._wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()   # one token once requested
        self._signalled = False
        self._previous: dict[int, object] = {}
        if install_signals:
            self.install()

    def install(self) -> StopFlag:
        """Catch SIGTERM and SIGINT; a no-op off the main thread (Python allows handlers only there)
        and when already installed."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before `install` (idempotent)."""
        while self._previous:
            sig, handler = self._previous.popitem()
            # None: the previous handler was not set from Python; the default is the nearest equivalent.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._signalled:
            _log(logging.WARNING, "got %s again: stopping at once", name)
            self.restore()
            signal.raise_signal(signum)
            return
        self._signalled = True
        self.set()
        _log(logging.INFO, "got %s: stopping gracefully (send it again to stop at once)", name)

    def set(self) -> None:
        """Request a graceful stop, as a first signal does (safe from any thread and from a handler)."""
        if not self._requested:
            self._requested = True
            self._wakeup.put(None)

    @property
    def requested(self) -> bool:
        return self._requested

    def __bool__(self) -> bool:
        return self._requested

    def wait(self, seconds: float | None = None) -> bool:
        """Sleep up to `seconds` (None: until requested), waking as soon as a stop is requested;
        returns `requested`."""
        if not self._requested:
            try:
                self._wakeup.get(timeout=None if seconds is None else max(seconds, 0.0))
            except queue.Empty:
                return self._requested
            self._wakeup.put(None)   # the token stays for any other waiting thread
        return self._requested

    def __enter__(self) -> StopFlag:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()


def _log(level: int, msg: str, *args) -> None:
    """Log from a signal handler, which may have interrupted a write to the same stream: the stream
    then refuses the nested write with RuntimeError ("reentrant call"), and the line is dropped."""
    try:
        log.log(level, msg, *args)
    except RuntimeError:
        pass
