"""The host memory this process's cgroup still lets it take: the tightest of the memory limits
of its own cgroup and of each parent up to the cgroup mount's root, less what each already uses.

The OOM killer acts on whichever of those limits is reached first, and the one that binds is
often below the mount's root: a Slurm job's cgroup, a ``systemd-run -p MemoryMax=`` scope (on
cgroup v2 the root has no ``memory.max`` at all). A container with its own cgroup namespace
(Docker's default on cgroup v2) sees its own cgroup as the root (``0::/``), which is read too.
A cgroup's usage counts its page cache, which the kernel reclaims before its OOM killer acts:
the inactive file pages (``memory.stat``'s ``inactive_file`` on v2, ``total_inactive_file``
on v1, both over the cgroup and its children as the usage is) are taken off it, as
``docker stats`` does. Where the memory controller lives comes from ``/proc/self/cgroup`` (v2: the ``0::PATH`` line;
v1: the line whose controllers include ``memory``), where that hierarchy is mounted, and which
of its cgroups the mount shows as its root, from ``/proc/self/mountinfo``.
"""

from __future__ import annotations

import dataclasses
import os
import re

PROC_CGROUP = "/proc/self/cgroup"
MOUNTINFO = "/proc/self/mountinfo"

# Per version: the limit file and the usage file of one cgroup.
FILES = {2: ("memory.max", "memory.current"), 1: ("memory.limit_in_bytes", "memory.usage_in_bytes")}
# Per version: the memory.stat key of the reclaimable page cache the usage counts (v1's
# ``inactive_file`` is the cgroup's own, ``total_inactive_file`` spans its children as the usage).
STAT_FILE = "memory.stat"
INACTIVE_FILE = {2: "inactive_file", 1: "total_inactive_file"}
V1_NO_LIMIT = 2**60  # v1 writes "no limit" as a huge number (LONG_MAX rounded to a page)


class CgroupError(OSError):
    """This process's memory cgroup cannot be found where the mount table says it is."""


@dataclasses.dataclass(frozen=True)
class Headroom:
    bytes: int | None  # None: no limit on the cgroup or its parents (or none can be seen)
    where: str  # which cgroup file gave it, or why there is none


def headroom(proc_cgroup: str = PROC_CGROUP, mountinfo: str = MOUNTINFO) -> Headroom:
    """The room the tightest memory limit over this process's cgroup and its parents leaves
    (limit less usage, in each cgroup's own files), and which files say so."""
    try:
        with open(proc_cgroup) as f:
            found = _memory_hierarchy(f.read())
    except FileNotFoundError:
        return Headroom(None, f"no {proc_cgroup}: this kernel has no cgroups")
    if found is None:
        return Headroom(None, f"no memory controller in {proc_cgroup}")
    version, path = found
    with open(mountinfo) as f:
        mount = _mount_of(version, path, f.read())
    if mount is None:
        return Headroom(None, f"no cgroup v{version} memory hierarchy is mounted here")
    tightest = None
    for folder in _cgroup_and_parents(version, path, proc_cgroup, mount, mountinfo):
        room = _room_in(folder, *FILES[version], INACTIVE_FILE[version])
        if room is not None and (tightest is None or room[0] < tightest[0]):
            tightest = room
    if tightest is None:
        return Headroom(
            None, f"no memory limit on cgroup {path} or its parents (cgroup v{version})"
        )
    return Headroom(*tightest)


def _memory_hierarchy(text: str) -> tuple[int, str] | None:
    """(1, path) where a v1 hierarchy holds the memory controller, else (2, path) from the
    unified hierarchy's ``0::`` line; None when neither is there."""
    unified = None
    for line in text.splitlines():
        number, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return 1, path
        if number == "0" and controllers == "":
            unified = path
    return None if unified is None else (2, unified)


def _mount_of(version: int, path: str, mountinfo: str) -> tuple[str, str] | None:
    """(mount point, the cgroup the mount shows as its root) of the hierarchy holding
    ``path``: the mount whose root is ``path`` or a parent of it, else the first mount of that
    hierarchy (then ``_cgroup_and_parents`` says the cgroup is out of its sight)."""
    mounts = []
    for line in mountinfo.splitlines():
        fields, _, fs = line.partition(" - ")
        fields, fs = fields.split(), fs.split()
        if len(fields) < 5 or len(fs) < 3:
            continue
        if (version == 2 and fs[0] == "cgroup2") or (
            version == 1 and fs[0] == "cgroup" and "memory" in fs[2].split(",")
        ):
            mounts.append((_unescape(fields[4]), _unescape(fields[3])))
    for point, root in mounts:
        if _relative(path, root) is not None:
            return point, root
    return mounts[0] if mounts else None


def _cgroup_and_parents(
    version: int, path: str, proc_cgroup: str, mount: tuple[str, str], mountinfo: str
) -> list[str]:
    """The folders of the cgroup ``path`` and of its parents up to the mount's root."""
    point, root = mount
    relative = _relative(path, root)
    folder = None if relative is None else os.path.join(point, *relative)
    if folder is None or not os.path.isdir(folder):
        raise CgroupError(
            f"this process's memory cgroup {path} ({proc_cgroup}) is not under the cgroup "
            f"v{version} mount {point} (which shows cgroup {root}, {mountinfo}), so its memory "
            "limit cannot be read; set HF_SUPEROFFLOAD_HOST_MEMORY_GIB to the GiB of host "
            "memory this job may use"
        )
    return [os.path.join(point, *relative[:depth]) for depth in range(len(relative), -1, -1)]


def _relative(path: str, root: str) -> list[str] | None:
    """The names leading from cgroup ``root`` down to cgroup ``path``; None if not below it."""
    names, root_names = _names(path), _names(root)
    if names[: len(root_names)] != root_names or ".." in names:
        return None
    return names[len(root_names) :]


def _names(path: str) -> list[str]:
    return [name for name in path.split("/") if name]


def _room_in(
    folder: str, limit_name: str, usage_name: str, inactive_key: str
) -> tuple[int, str] | None:
    """(limit less usage, which files) of one cgroup; None where it sets no limit (v2: no
    ``memory.max`` where the parent does not enable the controller, and none at the root).
    The usage is less its inactive page cache (``_inactive_file``)."""
    limit_file = os.path.join(folder, limit_name)
    if not os.path.exists(limit_file):
        return None
    limit_text = _read(limit_file)
    if limit_text == "max":
        return None
    limit = _bytes(limit_text, limit_file)
    if limit >= V1_NO_LIMIT:
        return None
    usage = _bytes(_read(os.path.join(folder, usage_name)), os.path.join(folder, usage_name))
    inactive = _inactive_file(os.path.join(folder, STAT_FILE), inactive_key)
    if inactive is None:  # the usage counted whole: a lower figure, never a higher one
        why = f"{usage_name}, whole: no {STAT_FILE} {inactive_key} line to take page cache off"
        inactive = 0
    else:
        why = (
            f"{usage_name} {usage / 2**30:.2f} GiB less {STAT_FILE} {inactive_key} "
            f"{inactive / 2**30:.2f} GiB, page cache the kernel reclaims first"
        )
    used = usage - min(inactive, usage)
    room = max(0, limit - used)
    return (
        room,
        f"cgroup limit {limit_file} {limit / 2**30:.2f} GiB less {used / 2**30:.2f} GiB used ({why})",
    )


def _inactive_file(stat_file: str, key: str) -> int | None:
    """The bytes of inactive page cache ``stat_file`` (a cgroup's ``memory.stat``) lists; None
    where the file or its line is missing (gVisor's cgroupfs has no ``memory.stat``)."""
    try:
        text = _read(stat_file)
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _bytes(value.strip(), stat_file)
    return None


def _read(file: str) -> str:
    with open(file) as f:
        return f.read().strip()


def _bytes(text: str, file: str) -> int:
    if not text.isdigit():
        raise CgroupError(f"{file} reads {text!r}, not a byte count")
    return int(text)


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)
