"""The machine's memory bandwidth: the ceiling of decode, which reads every weight (and the batch's KV)
once per step. An engine declares its chip (``tokentrace.host.chip``) and may declare a measured or
configured peak (``tokentrace.host.memory_bandwidth_gbs``, from ``--memory-bandwidth-gbs``); the decode
verdict takes that, else the published figure of the chip below, else says the peak is unknown.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

#: The vLLM plugin's way to declare the peak (vLLM has no option of ours to carry it).
ENV_MEMORY_BANDWIDTH = "TOKENTRACE_MEMORY_BANDWIDTH_GBS"

#: Published unified-memory bandwidth in GB/s (10^9 bytes/s), by the name macOS reports
#: (``sysctl machdep.cpu.brand_string``). Where a chip ships in two bandwidth configurations (M3 Max
#: 300/400, M4 Max 410/546) the higher is listed: a ceiling must not be exceeded.
#: Sources: Apple's product pages and newsroom releases for each chip.
APPLE_CHIPS = {
    "Apple M1": 68.25, "Apple M1 Pro": 200.0, "Apple M1 Max": 400.0, "Apple M1 Ultra": 800.0,
    "Apple M2": 100.0, "Apple M2 Pro": 200.0, "Apple M2 Max": 400.0, "Apple M2 Ultra": 800.0,
    "Apple M3": 100.0, "Apple M3 Pro": 150.0, "Apple M3 Max": 400.0, "Apple M3 Ultra": 819.0,
    "Apple M4": 120.0, "Apple M4 Pro": 273.0, "Apple M4 Max": 546.0,
}
#: Published HBM/GDDR bandwidth in GB/s by the name CUDA reports (``torch.cuda.get_device_name``),
#: for vLLM. Sources: NVIDIA's data sheets.
GPUS = {
    "NVIDIA H200": 4800.0, "NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H100 PCIe": 2000.0,
    "NVIDIA A100-SXM4-80GB": 2039.0, "NVIDIA A100 80GB PCIe": 1935.0, "NVIDIA A100-SXM4-40GB": 1555.0,
    "NVIDIA A100-PCIE-40GB": 1555.0, "NVIDIA L40S": 864.0, "NVIDIA A10G": 600.0, "NVIDIA L4": 300.0,
    "Tesla T4": 320.0, "NVIDIA GeForce RTX 4090": 1008.0, "NVIDIA GeForce RTX 3090": 936.0,
}
PEAKS = {**APPLE_CHIPS, **GPUS}


def chip_name() -> str | None:
    """This machine's chip as macOS names it ('Apple M2 Pro'); None elsewhere (a Linux CPU has no
    entry in the table, and its bandwidth depends on the DIMMs, not the CPU's name)."""
    if platform.system() != "Darwin":
        return None
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def available_memory() -> int | None:
    """The memory this host can still give a process without swapping: Linux's ``MemAvailable``
    (/proc/meminfo); None where it is not known (macOS reports its GPU's working set through MLX:
    the engine's heartbeat takes that there)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cuda_device_name() -> str | None:
    """The first CUDA device's name, when torch is already loaded (inside vLLM) and sees one."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
    except Exception:  # a broken CUDA setup must not stop the engine from serving
        return None


def vllm_resource() -> dict[str, str | float]:
    """The vLLM plugin's hardware resource attributes: the GPU's name, and the declared peak from
    ``TOKENTRACE_MEMORY_BANDWIDTH_GBS`` (ignored unless a positive number)."""
    from tokentrace import contract as c

    attributes: dict[str, str | float] = {}
    if name := cuda_device_name():
        attributes[c.HOST_CHIP] = name
    try:
        declared = float(os.environ.get(ENV_MEMORY_BANDWIDTH, ""))
    except ValueError:
        declared = 0.0
    if declared > 0:
        attributes[c.HOST_MEMORY_BANDWIDTH_GBS] = declared
    return attributes


def published_peak(chip: str | None) -> float | None:
    """The table's figure for ``chip`` (exact name, else the longest table name it begins with)."""
    if not chip:
        return None
    if chip in PEAKS:
        return PEAKS[chip]
    names = [name for name in PEAKS if chip.startswith(name + " ") or chip.startswith(name + "-")]
    return PEAKS[max(names, key=len)] if names else None


def peak_bandwidth(chip: str | None, declared: float | None) -> tuple[float | None, str]:
    """(GB/s, where it came from): the declared override, else the chip's published figure, else
    (None, 'unknown')."""
    if declared:
        return declared, "declared"
    value = published_peak(chip)
    return (value, "published") if value else (None, "unknown")
