"""The host-memory check reads the limits of this process's own cgroup and of its parents, not
those of the cgroup mount's root: a Slurm job or a ``systemd-run -p MemoryMax=`` scope is
limited below the root, and the OOM killer acts on that limit."""

from __future__ import annotations

import pytest
from cgroup_files import write_host

from hf_superoffload.engine import cgroup_memory, host_memory

GiB = 2**30
MiB = 2**20


def test_a_job_cgroup_below_the_root_limits_what_is_available(tmp_path, monkeypatch):
    """cgroup v2: no limit at the root, 1 GiB on the job's cgroup, 256 MiB of it used: 768 MiB
    left, not the host's 64 GiB of MemAvailable; the figure names the job's memory.max."""
    mount = write_host(
        tmp_path,
        monkeypatch,
        64 * GiB,
        cgroup="/job",
        limits={"": ("max", 5 * GiB), "job": (GiB, 256 * MiB)},
    )
    figure, source = host_memory.host_memory_available()
    assert figure == 768 * MiB == host_memory.host_bytes_available()
    assert f"{mount / 'job' / 'memory.max'} 1.00 GiB less 0.25 GiB used" in source
    assert "(memory.current 0.25 GiB less memory.stat inactive_file 0.00 GiB" in source


def test_cgroup_v1_reads_the_memory_controllers_line(tmp_path, monkeypatch):
    """A hybrid host (memory on v1, an empty unified hierarchy, ``0::/``, beside it): the
    ``memory`` line's cgroup, in v1's files."""
    mount = write_host(
        tmp_path,
        monkeypatch,
        64 * GiB,
        version=1,
        cgroup="/slurm/uid_1000/job_42",
        limits={"slurm/uid_1000/job_42": (8 * GiB, 2 * GiB)},
    )
    figure, source = host_memory.host_memory_available()
    assert figure == 6 * GiB
    assert str(mount / "slurm/uid_1000/job_42/memory.limit_in_bytes") in source
    assert "(memory.usage_in_bytes 2.00 GiB less memory.stat total_inactive_file" in source


@pytest.mark.parametrize("version", [2, 1])
def test_the_tightest_of_the_cgroup_and_its_parents_counts(tmp_path, monkeypatch, version):
    """The parent's 2 GiB limit with 1.5 GiB used leaves less than the child's own 4 GiB."""
    mount = write_host(
        tmp_path,
        monkeypatch,
        64 * GiB,
        version=version,
        cgroup="/user.slice/run.scope",
        limits={"user.slice": (2 * GiB, 1536 * MiB), "user.slice/run.scope": (4 * GiB, GiB)},
    )
    figure, source = host_memory.host_memory_available()
    assert figure == 512 * MiB
    assert str(mount / "user.slice" / cgroup_memory.FILES[version][0]) in source
    assert "run.scope" not in source


@pytest.mark.parametrize("version", [2, 1])
def test_page_cache_the_kernel_reclaims_is_not_counted_as_used(tmp_path, monkeypatch, version):
    """The usage files count the cgroup's page cache, which the kernel reclaims before its
    OOM killer acts: the inactive part (memory.stat's inactive_file, v1's total_inactive_file
    over the cgroup and its children) is free for the optimizer, as ``docker stats`` counts
    it. 8 GiB limit, 7 GiB used of which 3 GiB inactive page cache: 4 GiB left, not 1."""
    write_host(
        tmp_path,
        monkeypatch,
        64 * GiB,
        version=version,
        cgroup="/job",
        limits={"job": (8 * GiB, 7 * GiB, 3 * GiB)},
    )
    figure, source = host_memory.host_memory_available()
    assert figure == 4 * GiB
    usage_name = cgroup_memory.FILES[version][1]
    key = cgroup_memory.INACTIVE_FILE[version]
    assert f"less 4.00 GiB used ({usage_name} 7.00 GiB less memory.stat {key} 3.00 GiB" in source
    assert "page cache the kernel reclaims first" in source


def test_inactive_page_cache_above_the_usage_leaves_the_whole_limit(tmp_path, monkeypatch):
    """memory.stat and the usage file are read one after the other: a page cache figure above
    the usage (it grew between the reads) takes the usage to zero, not below."""
    write_host(tmp_path, monkeypatch, 64 * GiB, cgroup="/job", limits={"job": (GiB, MiB, 2 * MiB)})
    assert host_memory.host_bytes_available() == GiB


@pytest.mark.parametrize("version", [1, 2])
def test_without_the_page_cache_line_the_usage_counts_whole(tmp_path, monkeypatch, version):
    """A memory.stat without the line, or none at all (gVisor's cgroupfs writes no
    memory.stat), leaves the usage whole: the lower figure, which the message says."""
    limits = {"job": (GiB, 256 * MiB, 128 * MiB)}
    mount = write_host(
        tmp_path, monkeypatch, 64 * GiB, version=version, cgroup="/job", limits=limits
    )
    key = cgroup_memory.INACTIVE_FILE[version]
    assert host_memory.host_bytes_available() == GiB - 128 * MiB  # the line read
    (mount / "job" / "memory.stat").write_text("anon 0\nfile 0\n")
    assert host_memory.host_bytes_available() == GiB - 256 * MiB
    _, source = host_memory.host_memory_available()
    assert f"whole: no memory.stat {key} line to take page cache off" in source
    (mount / "job" / "memory.stat").unlink()
    assert host_memory.host_bytes_available() == GiB - 256 * MiB


def test_a_namespaced_container_reads_the_mounts_root(tmp_path, monkeypatch):
    """Docker's own cgroup namespace shows the container's cgroup as ``0::/``: its limit is
    the mount's root's."""
    write_host(tmp_path, monkeypatch, 64 * GiB, limits={"": (16 * GiB, 10 * GiB)})
    assert host_memory.host_bytes_available() == 6 * GiB


def test_a_mount_of_the_containers_own_cgroup_is_read_at_its_root(tmp_path, monkeypatch):
    """cgroup v1 without a cgroup namespace: /proc/self/cgroup names /docker/ID and the
    mount shows that cgroup as its root (mountinfo's root field)."""
    write_host(
        tmp_path,
        monkeypatch,
        64 * GiB,
        version=1,
        cgroup="/docker/0123abcd",
        mount_root="/docker/0123abcd",
        limits={"": (16 * GiB, 4 * GiB)},
    )
    assert host_memory.host_bytes_available() == 12 * GiB


def test_memavailable_counts_where_no_cgroup_limits(tmp_path, monkeypatch):
    write_host(tmp_path, monkeypatch, 64 * GiB, cgroup="/a/b", limits={"a": ("max", GiB)})
    figure, source = host_memory.host_memory_available()
    assert figure == 64 * GiB
    assert "MemAvailable" in source and "no memory limit on cgroup /a/b or its parents" in source
    # A looser limit is named beside the MemAvailable that binds.
    write_host(tmp_path / "loose", monkeypatch, 4 * GiB, cgroup="/a", limits={"a": (8 * GiB, 0)})
    figure, source = host_memory.host_memory_available()
    assert figure == 4 * GiB and "MemAvailable" in source and "tighter than" in source


def test_a_cgroup_out_of_the_mounts_sight_is_refused(tmp_path, monkeypatch):
    """The process's cgroup is not below what the mount shows: its limit cannot be read, and
    the error says what to set."""
    write_host(tmp_path, monkeypatch, 64 * GiB, version=1, cgroup="/a", mount_root="/a")
    (tmp_path / "cgroup").write_text("5:memory:/elsewhere\n0::/\n")
    with pytest.raises(cgroup_memory.CgroupError, match="HF_SUPEROFFLOAD_HOST_MEMORY_GIB"):
        host_memory.host_bytes_available()
    monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, "100")  # the way out it names
    assert host_memory.host_bytes_available() == 100 * GiB


def test_the_refusal_names_the_cgroup_file_that_limits(tmp_path, monkeypatch):
    mount = write_host(tmp_path, monkeypatch, 64 * GiB, cgroup="/job", limits={"job": (4 * GiB, 0)})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(host_memory.HostMemoryError) as err:
        host_memory.check_host_memory({"master": 5 * GiB}, "change something")
    assert f"only 4.00 GiB is available (cgroup limit {mount / 'job' / 'memory.max'}" in str(
        err.value
    )


def test_no_memory_controller_and_no_cgroups(tmp_path, monkeypatch):
    write_host(tmp_path, monkeypatch, 64 * GiB, version=1, cgroup="/a")
    (tmp_path / "cgroup").write_text("1:cpu,cpuacct:/\n")  # v1 without the memory controller
    assert host_memory.host_memory_available() == (
        64 * GiB,
        f"MemAvailable in {tmp_path / 'meminfo'}; no memory controller in {tmp_path / 'cgroup'}",
    )
    monkeypatch.setattr(host_memory, "PROC_CGROUP", str(tmp_path / "absent"))
    assert host_memory.host_bytes_available() == 64 * GiB


def test_mountinfo_escapes_are_read():
    assert cgroup_memory._unescape(r"/mnt/cgroup\040two") == "/mnt/cgroup two"


def test_env_reports_the_figure_the_check_counts(tmp_path, monkeypatch):
    from hf_superoffload.cli import env_facts

    mount = write_host(tmp_path, monkeypatch, 64 * GiB, cgroup="/job", limits={"job": (GiB, 0)})
    facts = env_facts.host_memory()
    assert facts["available_bytes"] == GiB and str(mount / "job" / "memory.max") in facts["source"]
    write_host(tmp_path, monkeypatch, 64 * GiB, cgroup="/job", limits={"job": (GiB, GiB, GiB)})
    facts = env_facts.host_memory()
    assert facts["available_bytes"] == GiB and "inactive_file 1.00 GiB" in facts["source"]
    (tmp_path / "cgroup").write_text("0::/elsewhere\n")
    facts = env_facts.host_memory()
    assert facts["available_bytes"] is None and "HF_SUPEROFFLOAD_HOST_MEMORY_GIB" in facts["error"]
