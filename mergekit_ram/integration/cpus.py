"""How many CPUs this process may use: its affinity mask and its cgroup's quota.

torch's default thread count reads neither a container's CPU quota nor
(everywhere) a `taskset` mask; the chunked walks' pool (core.parallel) is
sized from this instead. Reads /proc and /sys: the file system is this
layer's, not core's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cgroup_cpu_limit() -> float | None:
    """CPUs the cgroup (v2) quota allows this process, or None without one.

    The smallest `cpu.max` quota ÷ period on the way from this process's
    cgroup (PROC_CGROUP) up to the root (CGROUP_ROOT): a parent's limit
    binds its children too.
    """
    root = CGROUP_ROOT
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        lines = []
    # cgroup v2 writes one line "0::/path"; a container usually sees "/".
    path = next((ln[3:] for ln in lines if ln.startswith("0::")), "/")
    folder = root / path.strip("/")
    limits = []
    while True:
        limit = _quota(folder / "cpu.max")
        if limit is not None:
            limits.append(limit)
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    return min(limits, default=None)


def _quota(cpu_max: Path) -> float | None:
    """quota ÷ period from one `cpu.max` file ("max 100000": no limit)."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def usable_cpus() -> int:
    """How many CPUs this process may run on at once (at least 1).

    Its affinity mask (`taskset`, a container's cpuset), capped by its
    cgroup's CPU quota rounded up: a quota of 1.5 CPUs keeps two threads
    busy three quarters of the time, which still does more than one.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)
