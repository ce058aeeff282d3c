"""Compare-and-swap of a small file in a folder, for ``StorageLocation.read_aged``, ``write_if`` and ``delete_if``
when storage is a folder: one this host alone uses, or one on a network filesystem that several hosts share.

On a local disk the swap runs under ``flock`` of the folder and a file's age is taken with this host's clock, the
clock that stamped it. Neither holds on a network filesystem. Linux keeps ``flock`` of a directory on this host
(an NFS directory has no lock operation of its own), and a file's mtime there comes from the server's clock.
So on a network filesystem (``network_mount``, from /proc/self/mountinfo):

- The lock is a POSIX lock (``fcntl.lockf``) on a lock file in the folder, opened for writing. NFS (through NLM
  for v3, in the protocol for v4), SMB, CephFS, GlusterFS, GPFS and Lustre hold such locks for every host, and
  release them when their holder dies. An exclusive-create lock file would need no lock service, but one whose
  holder died must be broken after a timeout, and then two breakers, or a holder that was only paused, can both
  hold it. A mount whose options keep POSIX locks on this host is refused (``Mount.host_local_locks``).
- A file's age is the file server's time minus the file's mtime, where the filesystem lets the server stamp
  times: the server's time is the mtime it gives a probe file touched with ``os.utime(fd, None)`` (NFS asks the
  server to set it to its own time). Filesystems whose clients stamp times (SMB, CephFS, Lustre, GPFS) compare
  the two hosts' clocks there: keep their clocks in sync (NTP).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from raytrain_tasks.errors import StorageError

# Kept once made: deleting a lock file that another process waits on would let it and a newer locker in at once.
# remove_empty_folder deletes it with its folder, under the lock.
LOCK_FILE = ".raytrain-storage.lock"
PROBE_PREFIX = ".raytrain-clock-probe-"
LOCK_WAIT_S = 10.0  # the swap holds the lock for milliseconds; longer means a holder hung in a storage call
MOUNTINFO = "/proc/self/mountinfo"
NETWORK_FSTYPES = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs", "gfs2", "ocfs2"}
    # FUSE filesystems that hosts share. Others (fuse-overlayfs, gocryptfs, mergerfs) are one host's disk.
    | {f"fuse.{name}" for name in ("glusterfs", "ceph-fuse", "juicefs", "sshfs", "lizardfs", "mfs", "s3fs", "gcsfuse")}
)
# Mount options under which POSIX locks hold for this host only (NFS, SMB, Lustre), or fail (Lustre's noflock).
HOST_LOCAL_LOCK_OPTIONS = ("nolock", "local_lock=posix", "local_lock=all", "nobrl", "localflock", "noflock")

_BY_DEVICE: dict[int, Mount | None] = {}  # a filesystem's st_dev: its mount when it is a network one
# POSIX locks belong to the process: a second thread would get the lock it holds, and its close would drop it.
_IN_PROCESS: dict[str, threading.Lock] = {}
_IN_PROCESS_GUARD = threading.Lock()


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: frozenset[str]  # the mount's and its filesystem's options together

    @property
    def network(self) -> bool:
        """A filesystem other hosts may share, FUSE ones among them (sshfs, GlusterFS, JuiceFS)."""
        return self.fstype in NETWORK_FSTYPES

    def host_local_locks(self) -> str | None:
        """The option that keeps POSIX locks on this host; None when the mount shows none."""
        return next((option for option in HOST_LOCAL_LOCK_OPTIONS if option in self.options), None)


def parse_mountinfo_line(line: str) -> Mount | None:
    """The mount one line of /proc/self/mountinfo describes; None for a line that is not one."""
    fields = line.split()
    try:
        dash = fields.index("-", 6)  # optional fields end with a lone dash
        fstype = fields[dash + 1]
    except (ValueError, IndexError):
        return None
    options = fields[5].split(",") + (fields[dash + 3].split(",") if len(fields) > dash + 3 else [])
    point = re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), fields[4])
    return Mount(point, fstype, frozenset(options))


def mount_of(path: str, mountinfo: str) -> Mount | None:
    """The mount that holds the absolute ``path``: the deepest mount point above it, the last one mounted there."""
    found: Mount | None = None
    for line in mountinfo.splitlines():
        mount = parse_mountinfo_line(line)
        if mount is None:
            continue
        inside = path == mount.point or path.startswith(mount.point.rstrip("/") + "/")
        if inside and (found is None or len(mount.point) >= len(found.point)):
            found = mount
    return found


def network_mount(folder: str) -> Mount | None:
    """The network filesystem mount that holds ``folder``; None for a local one, or where there is no mountinfo."""
    existing = folder
    while True:  # a folder not made yet is on the filesystem of its nearest existing parent
        try:
            device = os.stat(existing).st_dev
            break
        except FileNotFoundError:
            if (parent := os.path.dirname(os.path.abspath(existing))) == os.path.abspath(existing):
                return None
            existing = parent
    if device not in _BY_DEVICE:  # mountinfo costs a hundred microseconds; a stat, a few
        try:
            mount = mount_of(os.path.realpath(existing), Path(MOUNTINFO).read_text())
        except OSError:
            mount = None
        _BY_DEVICE[device] = mount if mount is not None and mount.network else None
    return _BY_DEVICE[device]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def replace_file(path: str, data: bytes) -> None:
    """Write ``data`` under a temporary name beside ``path``, then rename it over ``path`` (atomic on POSIX)."""
    staged = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        Path(staged).write_bytes(data)
        os.replace(staged, path)
    finally:
        Path(staged).unlink(missing_ok=True)


def read_aged(path: str, network: bool | None = None) -> tuple[str, float] | None:
    """The file's text and seconds since it was last written, by the clock that stamped it; None when there is no
    file. ``network``: whether the folder is on a network filesystem (None: ask ``network_mount``)."""
    folder = _folder(path)
    if not _on_network(folder, network):
        try:
            with _local_lock(folder, fcntl.LOCK_SH):
                return Path(path).read_text(), time.time() - os.stat(path).st_mtime
        except FileNotFoundError:  # no such file, or no such folder
            return None
    # No lock: a write replaces the file whole, and the text and mtime come from the one file opened.
    try:
        with open(path, "rb") as stream:
            text = stream.read().decode()
            written = os.fstat(stream.fileno()).st_mtime
        return text, storage_now(folder) - written
    except FileNotFoundError:
        return None


def write_if(path: str, text: str, version: str | None, network: bool | None = None) -> str | None:
    """Write ``text`` only if the file's ``digest`` is still ``version`` (None: only if there is no file); the new
    version, or None when another writer got there first."""
    folder = _folder(path)
    os.makedirs(folder, exist_ok=True)
    with folder_lock(folder, network):
        try:
            current: str | None = digest(Path(path).read_text())
        except FileNotFoundError:
            current = None
        if current != version:
            return None
        replace_file(path, text.encode())
    return digest(text)


def delete_if(path: str, version: str, network: bool | None = None) -> bool:
    """Delete the file only if its ``digest`` is still ``version``; False when it changed or is gone."""
    try:
        with folder_lock(_folder(path), network):
            if digest(Path(path).read_text()) != version:
                return False
            os.remove(path)
    except FileNotFoundError:
        return False
    return True


def storage_now(folder: str) -> float:
    """The time by the clock of the filesystem that holds ``folder``: the mtime of a probe file it set to now."""
    probe = os.path.join(folder, f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}")
    descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.utime(descriptor, None)  # NFS: SETATTR with SET_TO_SERVER_TIME
        return os.fstat(descriptor).st_mtime
    finally:
        os.close(descriptor)
        os.unlink(probe)


def remove_empty_folder(folder: str) -> None:
    """Remove ``folder`` when it holds nothing, or only its lock file; leave it when it holds more."""
    if not (names := os.listdir(folder)):
        os.rmdir(folder)
        return
    if names != [LOCK_FILE]:
        return
    with folder_lock(folder, network=True):
        if os.listdir(folder) != [LOCK_FILE]:
            return
        os.unlink(os.path.join(folder, LOCK_FILE))  # a waiter on it sees it unlinked and makes a new one
    try:
        os.rmdir(folder)  # once the lock is closed: NFS keeps an open unlinked file as .nfsXXXX until then
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):  # another writer came meanwhile
            raise


def _folder(path: str) -> str:
    return os.path.dirname(path) or "."


def _on_network(folder: str, network: bool | None) -> bool:
    return network if network is not None else network_mount(folder) is not None


@contextmanager
def folder_lock(folder: str, network: bool | None = None, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """The exclusive lock a swap in ``folder`` runs under; on a network filesystem TimeoutError after ``wait_s``."""
    mount = network_mount(folder) if network is None else None
    if not (network or mount):
        with _local_lock(folder, fcntl.LOCK_EX):
            yield
        return
    if mount is not None and (option := mount.host_local_locks()) is not None:
        raise StorageError(
            f"storage folder {folder} is on {mount.fstype} at {mount.point}, mounted with {option}: file locks there "
            "hold for this host only, so drivers on two hosts could both take a run's lease. Mount it with locks "
            "that every host sees (NFS: without nolock or local_lock, with rpc.statd running; SMB: without nobrl; "
            "Lustre: with flock), or set `storage_path` to an s3:// bucket"
        )
    lock_path = os.path.join(folder, LOCK_FILE)
    with _IN_PROCESS_GUARD:
        in_process = _IN_PROCESS.setdefault(os.path.realpath(lock_path), threading.Lock())
    with in_process:
        descriptor = _lock_file(lock_path, wait_s)
        try:
            yield
        finally:
            os.close(descriptor)  # releases the lock


def _lock_file(path: str, wait_s: float) -> int:
    """An open descriptor of the lock file at ``path``, holding its exclusive POSIX lock."""
    deadline = time.monotonic() + wait_s
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # an exclusive POSIX lock needs it writable
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(descriptor).st_nlink > 0:  # else remove_empty_folder deleted it while we waited
                return descriptor
        except OSError as exc:
            # ESTALE: another host deleted the file. Polling, not a blocking lock: NFS grants a waiting lock by a
            # callback that firewalls drop, and then retries only every 30 s.
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.ESTALE):
                os.close(descriptor)
                if exc.errno == errno.ENOLCK:
                    raise OSError(
                        exc.errno,
                        f"no file locks on {path}: the file server's lock service (NFSv3: rpc.statd on "
                        "this host and on the server) is not running",
                    ) from exc
                raise
        os.close(descriptor)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"could not lock {path} in {wait_s:g} s: a process, maybe on another host, holds it (a lock "
                "of a process that died is released by the file server)"
            )
        time.sleep(random.uniform(0.002, 0.01))


@contextmanager
def _local_lock(folder: str, mode: int) -> Iterator[None]:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, mode)
        yield
    finally:
        os.close(descriptor)  # releases the lock
