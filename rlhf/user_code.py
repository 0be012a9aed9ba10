"""Calling a user's function (a reward function) so that it can neither end the run silently nor hang it.

A reward function runs on the main thread, where it always ran (signal-based timeouts inside it,
such as math_verify's, work only there), inside `user_call(call, timeout)`:

- A SystemExit or KeyboardInterrupt seen during the call is the function's own unless a signal
  reached the process meanwhile: for the call, every Python handler of SIGINT, SIGTERM, SIGHUP
  and SIGQUIT is wrapped to note the signal in `UserCall.signals` and then do what it did. So
  Ctrl-C still stops the run (or reaches the training loop's graceful stop), while `sys.exit(0)`
  or `raise KeyboardInterrupt` in a function can be reported as the function's error.
- With a timeout, a watchdog thread interrupts the call at its deadline: it sends
  DEADLINE_SIGNAL to the main thread, whose handler raises `CallTimedOut` inside the function;
  that wakes a sleep, a socket wait or a Python loop. A call still running GRACE_S seconds later
  (in C code that never returns to Python, or swallowing the exception) cannot be stopped, as no
  thread can: the watchdog prints the call's error line and ends the process with exit code 2
  rather than let the run hang.

Off the main thread (the async functions' event loop) no signal is delivered, so whatever a
function raises there is its own; `bounded_await` bounds an awaited call on the loop.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any, TypeVar

from rlhf.errors import UserError, debug_enabled

T = TypeVar("T")

# Signals whose Python handlers may raise into the code that runs when they arrive: the default
# SIGINT handler raises KeyboardInterrupt, a graceful-stop handler may exit on a second signal.
WATCHED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                        if hasattr(signal, name))
# What the watchdog sends the main thread at a deadline: SIGUSR2 is left to applications (SIGUSR1
# is the one faulthandler users register), and neither Python, torch nor torchrun uses it.
DEADLINE_SIGNAL: int | None = getattr(signal, "SIGUSR2", None)
# Seconds an interrupted call may take to unwind (its finally blocks) before the process ends.
GRACE_S = 5.0


class CallTimedOut(BaseException):
    """Raised inside a call that ran past its deadline; a BaseException, so that the function's own
    `except Exception` does not swallow it."""


@dataclass
class UserCall:
    """One call of user code: the line that ends the process if it cannot be interrupted, its
    deadline (time.monotonic), the signals that reached the process while it ran, and whether the
    deadline passed."""

    expired_line: str
    deadline: float = float("inf")
    signals: list[int] = field(default_factory=list)
    expired: bool = False
    interrupted: bool = False
    """`CallTimedOut` was raised in it (once only: a second one could land in its cleanup)."""
    raised: BaseException | None = None
    """What came out of the call itself (not its setup or cleanup)."""

    def raised_by_function(self, exc: BaseException) -> bool:
        """Whether `exc` came out of the call and is the function's own, not a signal's."""
        return exc is self.raised and (isinstance(exc, Exception) or not self.signals)


_current: UserCall | None = None  # the main thread's call in progress
_deadline_handler_installed = False


@contextmanager
def user_call(call: UserCall, timeout: float | None) -> Iterator[UserCall]:
    """Run the block as `call` (see the module docstring): signals noted, and with a timeout
    (seconds; None or 0: none) interrupted at its deadline by `CallTimedOut`."""
    global _current
    if threading.current_thread() is not threading.main_thread():
        try:  # no signal is delivered here; an awaited call is bounded by `bounded_await`
            yield call
        except BaseException as exc:
            call.raised = exc
            raise
        return
    outer, _current = _current, call
    previous = {}
    for signum in WATCHED_SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler):  # SIG_DFL / SIG_IGN raise nothing into Python code
            previous[signum] = handler
            signal.signal(signum, partial(_noted, call, handler))
    if timeout:
        call.deadline = time.monotonic() + timeout
        _WATCHDOG.arm(call, interrupt=_install_deadline_handler())
    try:
        yield call
    except BaseException as exc:
        call.raised = exc
        raise
    finally:
        _current = outer
        if timeout:
            _WATCHDOG.disarm(call)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _noted(call: UserCall, handler: Any, signum: int, frame: FrameType | None) -> None:
    call.signals.append(signum)
    handler(signum, frame)


def _install_deadline_handler() -> bool:
    """Install the DEADLINE_SIGNAL handler once (it then stays: a deadline signal sent just as a
    call returned must never meet the default action, which ends the process); False where the
    platform has no such signal."""
    global _deadline_handler_installed
    if DEADLINE_SIGNAL is None:
        return False
    if not _deadline_handler_installed:
        signal.signal(DEADLINE_SIGNAL, partial(_on_deadline, signal.getsignal(DEADLINE_SIGNAL)))
        _deadline_handler_installed = True
    return True


def _on_deadline(previous: Any, signum: int, frame: FrameType | None) -> None:
    call = _current
    if call is not None and call.expired and not call.interrupted:
        call.interrupted = True
        raise CallTimedOut
    if callable(previous):  # someone else's signal: their handler (a default action is dropped)
        previous(signum, frame)


class _Watchdog:
    """One daemon thread that interrupts the main thread's call at its deadline, and ends the
    process when the call still runs GRACE_S later."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.call: UserCall | None = None
        self.interrupt = True
        self.wakes_at = float("inf")  # when the thread looks again: a later deadline needs no wake-up
        self.thread: threading.Thread | None = None

    def arm(self, call: UserCall, interrupt: bool = True) -> None:
        with self.condition:
            self.call, self.interrupt = call, interrupt
            if self.thread is None or not self.thread.is_alive():  # first use, or a forked child
                self.thread = threading.Thread(target=self.run, name="rlhf-user-code-deadline", daemon=True)
                self.thread.start()
            elif call.deadline < self.wakes_at:
                self.condition.notify()

    def disarm(self, call: UserCall) -> None:
        with self.condition:
            if self.call is call:
                self.call = None

    def run(self) -> None:
        with self.condition:
            while True:
                call = self.call
                if call is None:
                    self.wakes_at = float("inf")
                    self.condition.wait()
                elif call.deadline > time.monotonic():
                    self.wakes_at = call.deadline
                    self.condition.wait(call.deadline - time.monotonic())
                elif not call.expired:
                    call.expired = True
                    call.deadline += GRACE_S
                    if self.interrupt and DEADLINE_SIGNAL is not None:
                        signal.pthread_kill(threading.main_thread().ident, DEADLINE_SIGNAL)
                else:
                    end_process(call.expired_line)


_WATCHDOG = _Watchdog()


def end_process(line: str) -> None:
    """The CLI's `error:` line and exit code 2, from a thread other than the stuck main thread
    (in a job of several ranks only the first to fail prints; torchrun stops the others)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()  # the error on a line of its own
    distributed = sys.modules.get("rlhf.engine.distributed")
    if distributed is None or not distributed.is_multi_process() or distributed.claim_error_report():
        sys.stderr.write(f"error: {line}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(UserError.exit_code)


async def bounded_await(awaitable: Awaitable[T], timeout: float | None) -> T:
    """`await awaitable` in the current task, cancelled after `timeout` seconds (None or 0: no
    limit) with `CallTimedOut` raised instead. Being awaited in the caller's task (not a task of
    its own, as asyncio.wait_for makes on Python 3.10), a SystemExit or KeyboardInterrupt it
    raises reaches the caller rather than the event loop, which re-raises those out of a task's
    own step and stops."""
    if not timeout:
        return await awaitable
    task = asyncio.current_task()
    assert task is not None
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    handle = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if not expired:
            raise
        if hasattr(task, "uncancel"):  # Python 3.11+: this cancellation is handled here
            task.uncancel()
        raise CallTimedOut from None
    finally:
        handle.cancel()


_module_ids = itertools.count()


def import_user_module(where: str, spec: str, flag: str, forms: str) -> ModuleType:
    """The module `where` of a user's `spec` (`flag` names the option in errors; `forms` what it
    takes): a .py file imported by its path, under a module name of its own (two files called
    rewards.py never clash, nor shadow an installed `rewards` module), or an importable module."""
    if where.endswith(".py") or "/" in where or "\\" in where:
        return _import_file(Path(where), spec, flag)
    if all(part.isidentifier() for part in where.split(".")):
        return _import_module(where, spec, flag)
    raise UserError(f"{flag} {spec!r}: {where!r} is neither a .py file nor a module name; expected {forms}")


def _import_file(path: Path, spec: str, flag: str) -> ModuleType:
    if not path.is_file():
        raise UserError(f"{flag} {spec}: no file {path} (path relative to {Path.cwd()})")
    name = f"_rlhf_user_{next(_module_ids)}_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"{flag} {spec}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling in the file look their module up here
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # sys.exit() at import would end the run silently
        del sys.modules[name]
        if debug_enabled():
            raise
        raise UserError(f"{flag} {spec}: importing {path} failed: {type(exc).__name__}: "
                        f"{_one_line(str(exc), 200)} (RLHF_DEBUG=1 shows the traceback)") from exc
    return module


def _import_module(module: str, spec: str, flag: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except (Exception, SystemExit) as exc:
        if debug_enabled():
            raise
        hint = " (is it installed, or on PYTHONPATH?)" if isinstance(exc, ModuleNotFoundError) else ""
        raise UserError(f"{flag} {spec}: importing module {module} failed: {type(exc).__name__}: "
                        f"{_one_line(str(exc), 200)}{hint}") from exc


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["CallTimedOut", "import_user_module", "DEADLINE_SIGNAL", "GRACE_S", "UserCall", "bounded_await", "end_process", "user_call"]
