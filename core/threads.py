"""Our threads under their own names in the operating system, so that ``top -H``, ``ps -L``,
``perf`` and ``/proc/PID/task/*/comm`` tell the collector's merge thread from its writer and its
decoders (CPython before 3.14 leaves every thread named after the process: "python").

The operating system's name is derived from the Python thread's: ``tokentrace-merge`` becomes
``tt-merge`` (Linux keeps 15 bytes of it). Where the system has no such name, or refuses it,
the thread keeps the one it had: naming is for people reading a process list, never a reason to fail.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

#: What the Python names of our threads start with, and what replaces it in the system's name.
PREFIX, SHORT = "tokentrace-", "tt-"
#: Bytes of a thread's name Linux keeps (16 with the terminating NUL); macOS keeps 63.
LIMIT = 15

T = TypeVar("T")


def os_name(name: str) -> str:
    """The system's name for a Python thread named ``name``: the prefix shortened, cut to ``LIMIT`` bytes."""
    if name.startswith(PREFIX):
        name = SHORT + name[len(PREFIX):]
    return name.encode("utf-8")[:LIMIT].decode("utf-8", "ignore")


@functools.cache
def _setter() -> Callable[[bytes], object] | None:
    """A function that names the calling thread, or None where there is none."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)  # the C library's symbols, without looking for its file
        if sys.platform.startswith("linux"):
            prctl, set_name = libc.prctl, 15  # PR_SET_NAME: the calling thread's name
            return lambda name: prctl(set_name, ctypes.c_char_p(name), 0, 0, 0)
        if sys.platform == "darwin":
            setname = libc.pthread_setname_np  # macOS: the calling thread only
            setname.argtypes = [ctypes.c_char_p]
            return setname
    except (ImportError, OSError, AttributeError):
        log.debug("threads cannot be named on this system", exc_info=True)
    return None


def name_os_thread(name: str | None = None) -> None:
    """Name the calling thread in the operating system after ``name`` (its Python name by default)."""
    setter = _setter()
    if setter is not None:
        setter(os_name(name or threading.current_thread().name).encode("utf-8"))


def os_named(target: Callable[..., T]) -> Callable[..., T]:
    """``target``, first naming the thread that runs it (``name_os_thread``): for ``threading.Thread``."""

    @functools.wraps(target)
    def run(*args, **kwargs) -> T:
        name_os_thread()
        return target(*args, **kwargs)

    return run


def lower_priority(by: int) -> None:
    """Make the calling thread's scheduling priority ``by`` lower (nice higher, at most 19). Linux
    keeps a nice per thread; elsewhere, or where the system refuses, the thread keeps the process's."""
    if by <= 0:
        return
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except (OSError, AttributeError):  # macOS takes a thread id for no process; Windows has no setpriority
        log.debug("could not lower the priority of %s", threading.current_thread().name, exc_info=True)
