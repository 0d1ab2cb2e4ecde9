"""Which machine's CPUs a process runs on: what a model service reports (ModelInfo.host_id, cpus)
so the coordinator can tell a draft and a target that share cores from two that do not."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # one per running kernel: its containers share it


@functools.cache  # fixed for the process's life; the pools' health checks ask for it every few seconds
def host_id() -> str:
    """The running kernel's boot id (the same for every process and container on one machine,
    new at each boot), else the host name."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return socket.gethostname()


def cpus() -> list[int]:
    """The CPUs this process may run on (its affinity, which may change: read each time; every CPU where
    that cannot be read)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def host_facts() -> dict:
    """ModelInfo's host_id and cpus."""
    return {"host_id": host_id(), "cpus": cpus()}
