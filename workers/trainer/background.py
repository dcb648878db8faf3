"""One job at a time in a background thread, its error handed to the caller's thread.

What the trainer overlaps with its next steps (a weights publication, a checkpoint upload): `start`
runs a job in a daemon thread, `join` waits for it and returns what it raised (None if nothing), so
the caller raises it on its own thread with its own words. Starting the next job first joins the last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Background:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, job: Callable[[], None], name: str) -> BaseException | None:
        """Join the last job, then start `job`; the last job's error, if any (the new one then does not start)."""
        error = self.join()
        if error is None:
            self._thread = threading.Thread(target=self.run, args=(job,), name=name, daemon=True)
            self._thread.start()
        return error

    def run(self, job: Callable[[], None]) -> None:
        """Run `job` here, keeping what it raises for `join`."""
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread by join()
            self._error = e

    def join(self) -> BaseException | None:
        """Until the job in flight is done; what it raised (once), or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error
