"""StopFlag: the first SIGTERM / SIGINT asks for a graceful stop, the second stops at once."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import REPO
from workers.stop import StopFlag


@pytest.fixture
def own_handlers():
    """Known handlers for SIGTERM and SIGINT during the test; pytest's are put back after it."""
    def term(*_):
        raise AssertionError("the test's SIGTERM handler ran")

    def intr(*_):
        raise AssertionError("the test's SIGINT handler ran")

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, term)
    signal.signal(signal.SIGINT, intr)
    yield {signal.SIGTERM: term, signal.SIGINT: intr}
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_sets_the_flag_logs_and_exit_restores(own_handlers, caplog, sig):
    caplog.set_level(logging.INFO, logger="asyncgrpo.stop")
    with StopFlag() as stop:
        assert not stop and not stop.requested and stop.wait(0.01) is False
        os.kill(os.getpid(), sig)          # handled in this (main) thread, at once
        assert stop.wait(5) is True and stop and stop.requested
        assert signal.getsignal(sig) not in own_handlers.values()   # still ours: the next one is the second
    assert signal.getsignal(signal.SIGTERM) is own_handlers[signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) is own_handlers[signal.SIGINT]
    assert f"got {signal.Signals(sig).name}: stopping gracefully" in caplog.text


def test_a_signal_wakes_the_main_thread_waiting_on_the_flag(own_handlers):
    with StopFlag() as stop:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        assert stop.wait(30) is True                # the generator's poll: cut short, not slept out
        assert time.monotonic() - t0 < 10
        assert stop.wait(30) is True and stop.wait(None) is True   # stays set; no second token needed


def test_restore_puts_back_previous_handlers_once_even_if_installed_twice(own_handlers):
    stop = StopFlag()                      # installs
    stop.install()                         # the trainer's way: a second install changes nothing
    assert signal.getsignal(signal.SIGTERM) not in own_handlers.values()
    stop.restore()
    stop.restore()                         # idempotent
    assert signal.getsignal(signal.SIGTERM) is own_handlers[signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) is own_handlers[signal.SIGINT]


def test_without_signals_and_off_the_main_thread_no_handler_is_installed(own_handlers):
    StopFlag(install_signals=False)
    made = []
    t = threading.Thread(target=lambda: made.append(StopFlag()))   # signal.signal would raise there
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is own_handlers[signal.SIGTERM]
    stop = made[0]
    threading.Timer(0.05, stop.set).start()
    assert stop.wait(10) is True and stop.requested
    stop.restore()                          # nothing to put back: a no-op, also off the main thread
    assert signal.getsignal(signal.SIGINT) is own_handlers[signal.SIGINT]


_SECOND_SIGNAL = textwrap.dedent("""
    import os, signal, sys, time
    from workers.stop import StopFlag

    sig = getattr(signal, sys.argv[1])
    # Python's own defaults, whatever this process inherited (a shell's background job starts
    # with SIGINT ignored, and "the previous handler" would then be SIG_IGN).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stop = StopFlag()
    if sys.argv[2] == "set":
        stop.set()                         # a caller's stop does not count as the first signal
    os.kill(os.getpid(), sig)
    assert stop.requested
    print("graceful", flush=True)
    try:
        os.kill(os.getpid(), sig)          # second signal: previous handler back, signal raised again
        time.sleep(5)
        print("survived", flush=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
        sys.exit(3)
""")


@pytest.mark.parametrize("first", ["signal", "set"])
@pytest.mark.parametrize("sig, rc, out", [
    ("SIGTERM", -signal.SIGTERM, "graceful\n"),                            # default: the process ends
    ("SIGINT", 3, "graceful\nKeyboardInterrupt True True\n"),              # default: KeyboardInterrupt
])
def test_second_signal_restores_the_previous_handlers_and_raises_again(sig, rc, out, first):
    p = subprocess.run([sys.executable, "-c", _SECOND_SIGNAL, sig, first], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert (p.returncode, p.stdout) == (rc, out), p.stderr
