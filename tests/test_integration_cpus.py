"""mergekit_ram.integration.cpus: the CPUs this process may use."""

from __future__ import annotations

import pytest

from mergekit_ram.integration import cpus as machine_cpus


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A fake cgroup v2 tree and affinity mask: machine(cpus, {path: cpu.max},
    cgroup path of this process)."""

    def make(cpus: int, limits: dict[str, str], own: str = "/") -> None:
        root = tmp_path / "cgroup"
        for folder, text in limits.items():
            (root / folder.strip("/")).mkdir(parents=True, exist_ok=True)
            (root / folder.strip("/") / "cpu.max").write_text(text + "\n")
        (root / own.strip("/")).mkdir(parents=True, exist_ok=True)
        membership = tmp_path / "self-cgroup"
        membership.write_text(f"0::{own}\n")
        monkeypatch.setattr(machine_cpus, "CGROUP_ROOT", root)
        monkeypatch.setattr(machine_cpus, "PROC_CGROUP", membership)
        monkeypatch.setattr(
            machine_cpus.os, "sched_getaffinity", lambda _pid: set(range(cpus))
        )

    return make


@pytest.mark.parametrize(
    "cpus, limits, own, usable",
    [
        (8, {}, "/", 8),  # no cgroup file: the affinity mask
        (8, {"/": "max 100000"}, "/", 8),  # no quota
        (8, {"/": "150000 100000"}, "/", 2),  # 1.5 CPUs: two threads
        (8, {"/": "50000 100000"}, "/", 1),  # half a CPU: still one
        (2, {"/": "400000 100000"}, "/", 2),  # the mask is smaller
        # A parent's quota binds its children; the smallest one counts.
        (16, {"/a": "300000 100000", "/a/b": "max 100000"}, "/a/b", 3),
        (16, {"/a": "600000 100000", "/a/b": "200000 100000"}, "/a/b", 2),
        (8, {"/": "garbage"}, "/", 8),  # unreadable: ignored
    ],
)
def test_usable_cpus_follow_affinity_and_cgroup_quota(
    machine, cpus, limits, own, usable
):
    machine(cpus, limits, own)
    assert machine_cpus.usable_cpus() == usable
