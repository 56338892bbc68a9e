"""
Stopping training cleanly: Ctrl-C or SIGTERM (a cluster's preemption, `kill`, torchrun passing
one on) asks the loop to finish its step, save and exit 0. A second signal acts as usual, so
Ctrl-C twice interrupts at once (the atomic save leaves the previous checkpoint whole).

Under torchrun, the death of the launcher does the same. torchrun starts its workers in sessions
of their own, so when its agent is killed with SIGKILL (which it cannot pass on) they would go on
training, unseen, into the out_dir the next launch uses; a worker notices that its parent process
is no longer the one it had when it joined the job (distributed.World.launcher, taken before the
setup, which may be long: a token scan, a compilation), and the job saves and stops.
"""

import os
import signal

import torch

from machinery.distributed import all_reduce


class StopFlag:
    """Catches SIGINT and SIGTERM until restore(); requested() says whether the loop should stop."""

    def __init__(self, launcher=None):
        self.name = None
        self.launcher = launcher  # under torchrun: its agent's pid (World.launcher)
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame):
        self.name = signal.Signals(signum).name
        self.restore()

    def requested(self, world, device, ask_ranks=True):
        """Has a signal come? Under torchrun every rank must stop at the same step, so a signal counts
        only on steps with ask_ranks (the same on every rank), where any rank's signal stops them all."""
        if not world.distributed:
            return self.name is not None
        if not ask_ranks:
            return False
        self._check_launcher()
        flag = all_reduce(torch.tensor([1.0 if self.name else 0.0], device=device), op="max").item() > 0
        if flag and self.name is None:
            self._check_launcher()  # (the launcher may have died after this rank looked, before another did)
            self.name = self.name or "a signal on another rank"
        return flag

    def _check_launcher(self):
        if self.name is None and self.launcher and os.getppid() != self.launcher:
            self.name = "the death of its launcher"  # (this process was handed to another parent, e.g. init)

    def restore(self):
        for sig, handler in self.previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)
