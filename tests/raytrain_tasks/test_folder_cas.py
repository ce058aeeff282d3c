"""Compare-and-swap in a storage folder on a network filesystem: the lock every host sees and the server's clock.

The mechanism works on any POSIX filesystem, so it is tested here on local folders (``network=True``); which
mounts use it is a pure function of /proc/self/mountinfo, tested on its lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raytrain_tasks.storage import folder_cas
from raytrain_tasks.storage.folder_cas import LOCK_FILE, mount_of, parse_mountinfo_line
from raytrain_tasks.storage.locations import locate, remove_empty_dirs
from tests.helpers import REPO_ROOT, wait_for

# One process of a contest: after the go file appears, it adds 1 to the counter file `rounds` times, each by a
# read and a compare-and-swap retried until it lands; prints the values it wrote and how often it lost.
CONTENDER = """
import sys, time
from pathlib import Path
from raytrain_tasks.storage import folder_cas
path, rounds, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
won, lost = [], 0
while len(won) < rounds:
    text, _ = folder_cas.read_aged(path, network=True)
    if folder_cas.write_if(path, str(int(text) + 1), folder_cas.digest(text), network=True) is None:
        lost += 1
    else:
        won.append(int(text) + 1)
print(lost, *won)
"""

HOLDER = """
import sys, time
from pathlib import Path
from raytrain_tasks.storage import folder_cas
with folder_cas.folder_lock(sys.argv[1], network=True):
    Path(sys.argv[2]).write_text("held")
    time.sleep(600)
"""

NFS4 = "41 27 0:52 / /mnt/shared rw,relatime shared:1 - nfs4 fs1:/export rw,vers=4.2,hard,proto=tcp,local_lock=none"


@pytest.mark.parametrize(
    ("line", "network", "host_local"),
    [
        (NFS4, True, None),
        ("42 27 0:53 / /mnt/v3 rw - nfs fs1:/x rw,vers=3,nolock,proto=tcp,local_lock=all", True, "nolock"),
        ("42 27 0:53 / /mnt/v3 rw - nfs fs1:/x rw,vers=3,proto=tcp,local_lock=posix", True, "local_lock=posix"),
        ("42 27 0:53 / /mnt/v3 rw - nfs fs1:/x rw,vers=3,proto=tcp,local_lock=flock", True, None),  # flock only
        ("43 27 0:54 / /mnt/smb rw,relatime - cifs //fs1/share rw,vers=3.1.1,cache=strict", True, None),
        ("43 27 0:54 / /mnt/smb rw,relatime - cifs //fs1/share rw,vers=3.1.1,nobrl", True, "nobrl"),
        ("43 27 0:54 / /mnt/smb rw - smb3 //fs1/share rw", True, None),
        ("44 27 0:55 / /mnt/lustre rw master:3 shared:4 - lustre 10.0.0.1@tcp:/fs rw,flock,lazystatfs", True, None),
        ("44 27 0:55 / /mnt/lustre rw - lustre 10.0.0.1@tcp:/fs rw,localflock", True, "localflock"),
        ("45 27 0:56 / /mnt/ceph rw - ceph 10.0.0.1:6789:/ rw,name=admin", True, None),
        ("46 27 0:57 / /gpfs rw - gpfs gpfs0 rw", True, None),
        ("47 27 0:58 / /mnt/beegfs rw - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf", True, None),
        ("48 27 0:59 / /mnt/gluster rw - fuse.glusterfs fs1:/vol rw,user_id=0,group_id=0", True, None),
        ("49 27 0:60 / /mnt/ssh rw - fuse.sshfs me@fs1:/x rw,user_id=0", True, None),
        ("50 27 8:1 / /mnt/usb rw - fuseblk /dev/sdb1 rw,user_id=0", False, None),
        ("53 27 0:63 / / rw - fuse.fuse-overlayfs fuse-overlayfs rw,user_id=0", False, None),  # rootless podman
        ("54 27 0:64 / /home/me rw - fuse.gocryptfs /home/.me rw,user_id=1000", False, None),
        ("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard", False, None),
        ("51 27 0:61 / /data rw - xfs /dev/nvme0n1 rw,attr2", False, None),
        ("25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683792k", False, None),
        ("52 27 0:62 / /var/lib/docker/x rw - overlay overlay rw,lowerdir=/a,upperdir=/b", False, None),
    ],
)
def test_a_network_filesystem_and_its_host_local_locks_are_told_from_its_mountinfo_line(
    line: str, network: bool, host_local: str | None
) -> None:
    mount = parse_mountinfo_line(line)
    assert mount is not None
    assert (mount.network, mount.host_local_locks()) == (network, host_local)


def test_a_folder_belongs_to_the_deepest_mount_above_it() -> None:
    mountinfo = "\n".join(
        [
            "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw",
            NFS4,
            "53 41 254:1 / /mnt/shared/scratch rw - ext4 /dev/vdb rw",
            r"54 27 0:63 / /mnt/team\040share rw - cifs //fs1/team rw",
            "not a mount line",
        ]
    )
    fstype = {path: getattr(mount_of(path, mountinfo), "fstype", None) for path in [
        "/mnt/shared", "/mnt/shared/runs/k", "/mnt/shared/scratch/runs", "/mnt/sharedother", "/mnt/team share/runs"
    ]}  # fmt: skip
    assert fstype == {
        "/mnt/shared": "nfs4",
        "/mnt/shared/runs/k": "nfs4",
        "/mnt/shared/scratch/runs": "ext4",
        "/mnt/sharedother": "ext4",
        "/mnt/team share/runs": "cifs",
    }
    remounted = mountinfo + "\n60 27 0:70 / /mnt/shared rw - ext4 /dev/vdc rw"  # mounted over it later
    assert getattr(mount_of("/mnt/shared/runs", remounted), "fstype", None) == "ext4"


@pytest.mark.parametrize("contenders", ["processes", "threads"])
def test_of_writers_contending_on_a_network_folder_exactly_one_wins_each_swap(tmp_path: Path, contenders: str) -> None:
    """Every increment lands once: two writers that read the same value cannot both replace it."""
    counter, go, rounds = tmp_path / "run" / "counter", tmp_path / "go", 300
    counter.parent.mkdir()
    counter.write_text("0")
    outputs: list[str] = []
    if contenders == "processes":
        command = [sys.executable, "-c", CONTENDER, str(counter), str(rounds), str(go)]
        started = [subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        go.touch()
        outputs = [process.communicate(timeout=120)[0] for process in started]
        assert [process.returncode for process in started] == [0, 0]
    else:
        barrier = threading.Barrier(2)

        def contend() -> None:
            won: list[int] = []
            lost = 0
            barrier.wait()
            while len(won) < rounds:
                text, _ = folder_cas.read_aged(str(counter), network=True)  # type: ignore[misc]
                if folder_cas.write_if(str(counter), str(int(text) + 1), folder_cas.digest(text), network=True):
                    won.append(int(text) + 1)
                else:
                    lost += 1
            outputs.append(" ".join(map(str, [lost, *won])))

        threads = [threading.Thread(target=contend) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    results = [list(map(int, output.split())) for output in outputs]
    won = sorted(value for result in results for value in result[1:])
    assert won == list(range(1, 2 * rounds + 1)), "an increment was won twice, or lost"
    assert counter.read_text() == str(2 * rounds)
    assert sum(result[0] for result in results) > 0, "the writers never contended: the test proved nothing"
    assert sorted(p.name for p in counter.parent.iterdir()) == sorted([LOCK_FILE, "counter"])  # no probe left


@pytest.mark.chaos
def test_a_lock_whose_holder_was_killed_holding_it_is_free_at_once(tmp_path: Path) -> None:
    """The lock file stays behind, but the file server releases a dead process's lock: no timeout to wait out."""
    run, held = tmp_path / "run", tmp_path / "held"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(held)], cwd=REPO_ROOT)
    try:
        wait_for(held.exists, timeout=30, what="the holder to take the lock")
        with pytest.raises(TimeoutError, match="another host"), folder_cas.folder_lock(str(run), True, wait_s=0.3):
            pytest.fail("two processes held the lock at once")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (run / LOCK_FILE).exists()
    started = time.monotonic()
    assert folder_cas.write_if(str(run / "lease"), "mine", None, network=True) == folder_cas.digest("mine")
    assert time.monotonic() - started < 1.0


def test_the_age_on_a_network_folder_is_the_servers_time_less_the_files_not_this_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = tmp_path / "lease"
    lease.write_text("held")
    stamped = folder_cas.storage_now(str(tmp_path)) - 1000  # the server stamped it 1000 s ago
    os.utime(lease, (stamped, stamped))
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)  # this host's clock is an hour ahead
    text, age = folder_cas.read_aged(str(lease), network=True)  # type: ignore[misc]
    assert text == "held" and 1000 <= age < 1010
    # A local disk has one clock, this host's, which stamped the file: it is the one read there.
    assert 4600 <= folder_cas.read_aged(str(lease), network=False)[1] < 4610  # type: ignore[index]
    os.utime(lease, (stamped + 1100, stamped + 1100))  # stamped 100 s ahead of the probe: the age follows
    assert -100 <= folder_cas.read_aged(str(lease), network=True)[1] < -90  # type: ignore[index]
    assert [p.name for p in tmp_path.iterdir()] == ["lease"]  # the probe is gone
    assert folder_cas.read_aged(str(tmp_path / "none"), network=True) is None


def test_a_network_run_folder_holding_only_its_lock_file_is_removed_like_an_empty_one(tmp_path: Path) -> None:
    """A run that never started leaves no folder behind on a network filesystem either."""
    run, kept = tmp_path / "never-started", tmp_path / "started"
    for folder in (run, kept):
        version = folder_cas.write_if(str(folder / "lease"), "held", None, network=True)
        assert version is not None and folder_cas.delete_if(str(folder / "lease"), version, network=True)
    (kept / "checkpoint_1").mkdir()
    remove_empty_dirs([locate(str(run)), locate(str(kept))])
    assert not run.exists()
    assert sorted(p.name for p in kept.iterdir()) == sorted([LOCK_FILE, "checkpoint_1"])


def test_on_a_local_disk_the_swap_leaves_no_lock_or_probe_file(tmp_path: Path) -> None:
    """A local disk keeps the folder lock and this host's clock: the run's folder holds the lease and nothing else."""
    assert folder_cas.network_mount(str(tmp_path)) is None  # this test's folder is on a local disk
    lease = locate(str(tmp_path / "run")).child("lease")
    version = lease.write_if("one", None)
    assert version is not None and lease.write_if("two", version) is not None
    found = lease.read_aged()
    assert found is not None and found.text == "two" and 0 <= found.age_s < 60
    assert sorted(os.listdir(tmp_path / "run")) == ["lease"]
