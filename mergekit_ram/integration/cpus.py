"""How many CPUs this process may use: its affinity mask.

torch's default thread count does not read a `taskset` mask everywhere; the
chunked walks' pool (core.parallel) is sized from this, at most torch's
thread count. A container's CPU quota (cgroup `cpu.max`) is not read: a
caller who wants fewer threads sets torch's (docs/performance.md, Threads).
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """How many CPUs this process may run on at once (at least 1): its
    affinity mask (`taskset`, a container's cpuset), or every CPU where the
    platform has no affinity call."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1
