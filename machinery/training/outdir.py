"""
A training run's out_dir, owned by one run at a time.

claim(out_dir) creates it if needed, checks that it takes files, and locks it for the life of the
run: `out_dir/train.lock`, held with flock(2). The kernel releases the lock when the process ends in
any way (an error, Ctrl-C, SIGKILL, a crash), so a dead run never blocks the next one, and a run
that is alive always does: a second train.py on the same out_dir stops with one line naming the
first (its pid, host, start time and command, which the holder writes into the lock file). Only the
holder removes the temporary files a killed run left there, so it never deletes a checkpoint that
another run is in the middle of writing.

Under torchrun only rank 0 writes into out_dir, so only rank 0 claims it. (Where the OS has no
flock, e.g. Windows, out_dir is not locked.)
"""

import json
import os
import socket
import sys
import time

from machinery.errors import UserError
from machinery.fileio import atomic_write, remove_stale_temps

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None

LOCK = "train.lock"


class OutDirLock:
    """The claim on an out_dir (see claim), held through an open file descriptor: release() ends it, and so
    does dropping the object (a Trainer that is never run) or the end of the process."""

    def __init__(self, fd):
        self.fd = fd

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops its flock
            self.fd = None

    __del__ = release


def claim(out_dir):
    """Create out_dir, lock it for this run (an OutDirLock), check that it takes checkpoints, and remove the
    temporary files a killed run left there. A one-line error when another run holds it."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"out_dir {out_dir} is a file; pick a directory with --out_dir")
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = OutDirLock(os.open(os.path.join(out_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as e:
        raise UserError(f"out_dir {out_dir} is not writable ({e.strerror}); pick another --out_dir") from None
    if fcntl is not None:
        try:
            fcntl.flock(lock.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.lseek(lock.fd, 0, os.SEEK_SET)
            holder = _describe(os.read(lock.fd, 4096).decode("utf-8", "replace"))
            lock.release()
            raise UserError(f"out_dir {out_dir} is in use by another training run ({holder}); wait for it to end, "
                            f"stop it, or pick another --out_dir") from None
    try:
        with atomic_write(os.path.join(out_dir, ".write_test")):  # what a checkpoint save does: temp, fsync, rename
            pass
        os.remove(os.path.join(out_dir, ".write_test"))
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)}
        os.ftruncate(lock.fd, 0)
        os.lseek(lock.fd, 0, os.SEEK_SET)
        os.write(lock.fd, (json.dumps(holder) + "\n").encode("utf-8"))
        remove_stale_temps(out_dir)
    except OSError as e:
        lock.release()
        raise UserError(f"out_dir {out_dir} is not writable ({e.strerror}); pick another --out_dir") from None
    return lock


def _describe(text):
    """The holder, as its lock file says: pid, host, start time and command."""
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
    except (ValueError, KeyError, TypeError):
        return "its lock file names no process"
