"""A host's memory files under a test's folder: /proc/meminfo, /proc/self/cgroup,
/proc/self/mountinfo and a cgroup mount (v2 or v1) with limits on the cgroups asked for."""

from __future__ import annotations

from pathlib import Path

from hf_superoffload.engine import host_memory

V1_NO_LIMIT = 9223372036854771712  # what cgroup v1 writes for "no limit" on x86-64
FILES = {2: ("memory.max", "memory.current"), 1: ("memory.limit_in_bytes", "memory.usage_in_bytes")}
INACTIVE_FILE = {2: "inactive_file", 1: "total_inactive_file"}  # memory.stat's page cache line


def write_host(
    folder: Path,
    monkeypatch,
    mem_available: int,
    *,
    version: int = 2,
    cgroup: str = "/",
    limits: dict[str, tuple[int | str, int] | tuple[int | str, int, int]] | None = None,
    mount_root: str = "/",
) -> Path:
    """``mem_available`` bytes of MemAvailable; this process in ``cgroup`` of a cgroup
    ``version`` hierarchy whose mount shows cgroup ``mount_root`` as its root; ``limits``:
    cgroup folder below the mount ("" its root) -> (limit bytes or "max", usage bytes[, bytes
    of the usage that are inactive page cache, 0 if not given]), in memory.stat beside other
    lines as the kernel writes them (v1 lists the cgroup's own ``inactive_file`` before the
    ``total_inactive_file`` that spans its children).
    Other folders on the way get no limit (v2: no memory.max; v1: its "no limit" figure).
    Points host_memory at these files; returns the mount's folder."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = folder / "mount"
    mount.mkdir(exist_ok=True)
    (folder / "meminfo").write_text(
        f"MemTotal: {1 << 40 >> 10} kB\nMemAvailable:   {mem_available >> 10} kB\n"
    )
    limit_name, usage_name = FILES[version]
    below = [name for name in cgroup.split("/") if name]
    if mount_root != "/":
        below = below[len([name for name in mount_root.split("/") if name]) :]
    for depth in range(len(below) + 1):
        (mount / "/".join(below[:depth])).mkdir(parents=True, exist_ok=True)
        if version == 1:
            (mount / "/".join(below[:depth]) / limit_name).write_text(f"{V1_NO_LIMIT}\n")
            (mount / "/".join(below[:depth]) / usage_name).write_text("4096\n")
            write_stat(mount / "/".join(below[:depth]), version, 0)
    for name, (limit, usage, *inactive) in (limits or {}).items():
        (mount / name).mkdir(parents=True, exist_ok=True)
        (mount / name / limit_name).write_text(f"{limit}\n")
        (mount / name / usage_name).write_text(f"{usage}\n")
        write_stat(mount / name, version, inactive[0] if inactive else 0)
    if version == 2:
        (folder / "cgroup").write_text(f"0::{cgroup}\n")
        mounts = f"30 23 0:26 {mount_root} {mount} rw,nosuid - cgroup2 cgroup2 rw\n"
    else:  # a hybrid host: the memory controller on v1, an empty unified hierarchy beside it
        (folder / "cgroup").write_text(f"5:memory:{cgroup}\n1:cpu,cpuacct:/\n0::/\n")
        mounts = (
            f"32 31 0:29 / {folder / 'cpu'} rw - cgroup cgroup rw,cpu,cpuacct\n"
            f"35 31 0:32 {mount_root} {mount} rw,relatime - cgroup cgroup rw,memory\n"
            f"41 31 0:38 / {folder / 'unified'} rw - cgroup2 cgroup2 rw\n"
        )
    (folder / "mountinfo").write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n" + mounts)
    monkeypatch.setattr(host_memory, "MEMINFO", str(folder / "meminfo"))
    monkeypatch.setattr(host_memory, "PROC_CGROUP", str(folder / "cgroup"))
    monkeypatch.setattr(host_memory, "MOUNTINFO", str(folder / "mountinfo"))
    return mount


def write_stat(folder: Path, version: int, inactive: int) -> None:
    """A cgroup's memory.stat with ``inactive`` bytes of inactive page cache (v2:
    ``inactive_file``; v1: ``total_inactive_file``, after the cgroup's own ``inactive_file``
    line, 1 byte here, which does not count the children the usage counts)."""
    lines = ["anon 1048576", "file 8192"]
    if version == 1:
        lines.append("inactive_file 1")
    lines += [f"{INACTIVE_FILE[version]} {inactive}", "active_file 4096"]
    (folder / "memory.stat").write_text("\n".join(lines) + "\n")
