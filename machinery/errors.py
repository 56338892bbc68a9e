"""
The project's error for mistakes in what the user asked for, and how scripts report it.

A UserError carries one line that names the problem and the fix. Every script runs its
main() through run_main, which prints that line as `error: ...` on stderr and exits with
status 2: no traceback, since the user has nothing to debug, only something to change.
"""

import os
import sys


class UserError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2, no traceback."""


def run_main(main):
    """Run a script's main(); a UserError becomes `error: <message>` on stderr and exit status 2."""
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def exit_without_teardown(status=0):
    """End the process now, its output flushed, skipping Python's teardown: finalizing the thousands of modules
    and objects that importing torch makes takes ~0.4 s (a sixth of sample.py's start-up to its first token,
    BENCHMARKS.md). Only for a command that has finished its work and holds nothing that teardown would finish
    (no file written, no atexit work such as wandb's): sample.py."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: there is no one left to read it
            pass
    os._exit(status)


def first_line(e, limit=200):
    """The first line of an exception's message (or its type's name), to quote inside a UserError."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__
