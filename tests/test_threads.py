"""core/threads.py (tokentrace.threads): our threads carry their role in the operating system's thread list."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tokentrace.threads import LIMIT, name_os_thread, os_name, os_named

linux_only = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from Linux's /proc")


def test_the_system_name_is_the_python_name_shortened_to_what_linux_keeps():
    assert os_name("tokentrace-merge") == "tt-merge"
    assert os_name("tokentrace-decode_3") == "tt-decode_3"
    assert os_name("tokentrace-gateway-observer") == "tt-gateway-obse"  # 15 bytes
    assert os_name("worker") == "worker"  # not ours: kept, only cut
    assert os_name("é" * 20).encode() == ("é" * 7).encode()  # never half a character
    assert all(len(os_name(name).encode()) <= LIMIT for name in ("x" * 40, "tokentrace-" + "y" * 40))


def _comm(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


@linux_only
def test_a_thread_started_through_os_named_carries_its_name():
    seen = []

    def work(value):
        seen.append((value, _comm(threading.get_native_id())))

    thread = threading.Thread(target=os_named(work), args=(7,), name="tokentrace-merge")
    thread.start()
    thread.join()
    assert seen == [(7, "tt-merge")]  # the target ran, with its arguments, under the system name


@linux_only
def test_a_pool_named_by_its_initializer_names_every_thread():
    with ThreadPoolExecutor(3, thread_name_prefix="tokentrace-read", initializer=name_os_thread) as pool:
        barrier = threading.Barrier(3)

        def name():
            barrier.wait(10)  # three threads at once: the pool starts all three
            return _comm(threading.get_native_id())

        names = sorted(future.result() for future in [pool.submit(name) for _ in range(3)])
    assert names == ["tt-read_0", "tt-read_1", "tt-read_2"]


@linux_only
def test_an_explicit_name_replaces_the_python_one_for_the_system_only():
    got = []

    def work():
        name_os_thread("tokentrace-probe")
        got.append((threading.current_thread().name, _comm(threading.get_native_id())))

    thread = threading.Thread(target=work, name="kept")
    thread.start()
    thread.join()
    assert got == [("kept", "tt-probe")]
