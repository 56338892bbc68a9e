"""
What packing.calibrate measured on this machine, kept in a JSON file for the next start (sample.py and serve.py):
measuring takes time at every start (BENCHMARKS.md), and the answer is the kernels', not the model's.

A layer's entry (layer_key) holds the min_rows calibrate set, the most rows it found a pass may hold, and the most
rows it measured up to: a later engine takes it where that answers its own max_batch, and measures otherwise. The
whole file belongs to one machine, named by what decides the choice of kernels (machine): anything else, and the
file is ignored and written anew; where the CPU cannot be named, nothing is kept and calibrate measures every time.
The file is $XDG_CACHE_HOME (or ~/.cache) /nanogpt/calibration.json, written atomically; a file that cannot be
read or written only makes the next start measure again. Not here: the measuring itself (packing.calibrate).
"""

import json
import os

import torch

from machinery.fileio import atomic_write, cache_path

CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")  # (x86; ARM: no flags line)
ENVIRONMENT = ("ONEDNN_", "DNNL_", "ATEN_CPU_CAPABILITY", "OMP_", "MKL_")


def machine():
    """What decides which kernels compute a product here, or None where the CPU cannot be named (no
    /proc/cpuinfo): the CPU (vendor, family, model and flags), the torch build (which bundles oneDNN), the threads,
    the CPU capability PyTorch dispatches to, and the environment variables that cap or tune them (ENVIRONMENT)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return None
    fields = dict(map(str.strip, line.split(":", 1)) for line in first.splitlines() if ":" in line)
    cpu = {name: fields[name] for name in CPU_FIELDS if name in fields}
    if "flags" not in cpu:
        return None
    return {"cpu": cpu, "torch": torch.__version__, "build": torch.version.git_version,
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENVIRONMENT)}}


def layer_key(linear):
    """How the file names a layer's measurement: the kernels it runs are decided by these alone."""
    cls, rows, cols = type(linear), linear.out_features, linear.in_features
    return f"{cls.__module__}.{cls.__qualname__} {rows}x{cols} {linear.dtype} bias={linear.bias is not None}"


class CalibrationCache:
    """calibrate's measurements on this machine (the module's docstring): get() before measuring, put() after."""

    def __init__(self, path=None):
        self.path = path or cache_path("calibration.json")
        self.machine = machine()
        self.layers = self._read() if self.machine else {}
        self.changed = False

    def _read(self):
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            layers = data["layers"]
            return layers if data["machine"] == self.machine and isinstance(layers, dict) else {}
        except (OSError, ValueError, TypeError, KeyError):
            return {}

    def get(self, linear, most):
        """(min_rows, the most rows up to most that a pass may hold) for linear, or None where not measured up to
        most here."""
        entry = self.layers.get(layer_key(linear))
        if not isinstance(entry, dict) or not all(type(entry.get(k)) is int and entry[k] >= 1
                                                  for k in ("min_rows", "limit", "measured")):
            return None
        if entry["limit"] < entry["measured"]:  # a pass of limit + 1 rows rounds otherwise: the answer for any most
            return entry["min_rows"], min(entry["limit"], most)
        return (entry["min_rows"], most) if most <= entry["measured"] else None

    def put(self, linear, most, min_rows, limit):
        """Keep a measurement (min_rows and limit, calibrate's, measured up to most rows) until save()."""
        self.layers[layer_key(linear)] = {"min_rows": min_rows, "limit": limit, "measured": most}
        self.changed = True

    def save(self):
        """Write the file, if put() added to it (a home that cannot be written: the next start measures again)."""
        if self.machine is None or not self.changed:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with atomic_write(self.path, "w", encoding="utf-8") as f:
                json.dump({"machine": self.machine, "layers": self.layers}, f, indent=1)
            self.changed = False
        except OSError:
            pass
