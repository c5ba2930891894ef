"""The CPU a measurement ran on: its name and the instruction-set extensions that decide which
kernels torch and llama.cpp pick, read from /proc/cpuinfo in this one place; and how many of
its cores this process may run on (``default_threads``).

Calibration caches key on them (``costs``, ``backends.hf_loading``), and the bench and load
reports print them, so all of them must read the same flags the same way. (The wheel cache of
``scripts/install_llama_cpp.sh`` keeps its own reader: a shell script cannot import this.)
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The extensions that decide llama.cpp's and torch's CPU kernels: AVX2, every AVX-512 part, AMX.
KERNEL_FLAG_PREFIXES = ("avx2", "avx512", "amx")


def cpuinfo_text(path: Path = CPUINFO) -> str:
    """/proc/cpuinfo, or "" where there is none (not Linux) or it cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _field(cpuinfo: str, name: str) -> str | None:
    """The value of the first ``name`` line (the first core's), or None."""
    for line in cpuinfo.splitlines():
        if line.startswith(name) and ":" in line:
            return line.split(":", 1)[1].strip()
    return None


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name; what the platform module says where /proc/cpuinfo has none."""
    text = cpuinfo_text() if cpuinfo is None else cpuinfo
    return _field(text, "model name") or platform.processor() or platform.machine()


def kernel_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU's kernel-deciding extensions (``KERNEL_FLAG_PREFIXES``), sorted."""
    text = cpuinfo_text() if cpuinfo is None else cpuinfo
    flags = (_field(text, "flags") or "").split()
    return sorted(f for f in flags if f.startswith(KERNEL_FLAG_PREFIXES))


def default_threads() -> int:
    """One thread per core this process may run on: its CPU affinity, which a container, a
    cgroup or ``taskset`` can make smaller than the machine's ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1
