"""
The project's small files, read and written safely.

atomic_write(path) hands out a temporary file beside path; only when the block ends
without an exception is the file flushed, fsynced and renamed over path (and the rename
made durable). A process killed at any instant leaves either the old complete file or
the new complete one. Temporary files are named `.NAME.tmp.PID`, so that a later run can
find and remove what a killed one left (remove_stale_temps).

read_text(path, what, fix) reads a UTF-8 text file, and read_json_object(path, fix) a JSON file that
must hold an object, each with a one-line error that ends with the fix.
"""

import json
import os
from contextlib import contextmanager

from machinery.errors import UserError, first_line


def temp_path(path):
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.tmp.{os.getpid()}")


@contextmanager
def atomic_write(path, mode="wb", **open_kwargs):
    """with atomic_write(path) as f: write to f; path is replaced only if the block succeeds."""
    tmp = temp_path(path)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_directory(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _fsync_directory(directory):
    """Make a rename inside directory durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(directory, names=None):
    """Delete the temporary files that a killed process left in directory (they can be gigabytes): those
    of the given file names, or all of them."""
    for entry in os.listdir(directory):
        name, marker, pid = entry[1:].rpartition(".tmp.")
        if entry.startswith(".") and marker and pid.isdigit() and (names is None or name in names):
            os.remove(os.path.join(directory, entry))


def cache_path(name):
    """Where the project keeps the cache file name: $XDG_CACHE_HOME (or ~/.cache) /nanogpt/name."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "nanogpt", name)


def read_text(path, what, fix):
    """The text of a UTF-8 file; one that cannot be opened or is not UTF-8 is a one-line error naming what the
    file is for (e.g. "--text") and the fix."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {what} {path} ({getattr(e, 'strerror', None) or first_line(e)}); {fix}") from None


def read_json_object(path, fix, kind=dict):
    """The dict (kind list: the list) in a JSON file; a file that is not valid JSON or holds none is a one-line
    error."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not valid JSON ({e}){fix}") from None
    if not isinstance(value, kind):
        raise UserError(f"{path} does not hold a JSON {'object' if kind is dict else 'list'}{fix}")
    return value
