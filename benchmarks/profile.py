"""
Where a unit of work spends its time, kernel by kernel: bench.py --mode=gpu's profile sections (a training step,
a decoded token). The work runs under torch.profiler and the kernels that took the most device time are printed
per unit (a step, a token), so that a GPU's few lent minutes show what to work on next. On a CPU the table lists
PyTorch's operators by their own CPU time instead (the quick form: the section prints, its figures are the CPU's).
"""

from dataclasses import dataclass

import torch


@dataclass
class Kernel:
    """One row of the table: a kernel (or, on a CPU, an operator), its calls and time per unit of work."""

    name: str
    calls: float  # per unit
    us: float  # microseconds per unit
    share: float  # of the device's (the CPU's) whole time in the profiled work


def top_kernels(run, units, device, top=10):
    """run() under torch.profiler, done `units` units of work: its `top` kernels by their own device time (CUDA's
    kernels and copies, or the CPU's operators), and the whole time per unit in microseconds."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        if cuda:
            torch.cuda.synchronize(device)
    events = [(e.key, e.count, own_time(e, cuda)) for e in prof.key_averages()]
    events = [e for e in events if e[2] > 0]
    total = sum(t for _, _, t in events)
    ranked = sorted(events, key=lambda e: -e[2])[:top]
    return [Kernel(name, count / units, t / units, t / total) for name, count, t in ranked], total / units


def own_time(event, cuda):
    """An averaged profiler event's own time in microseconds: on the device for CUDA (the host's operators have
    none: only kernels and copies count), else on the CPU."""
    if cuda:
        return event.self_device_time_total if event.device_type == torch.autograd.DeviceType.CUDA else 0.0
    return event.self_cpu_time_total


def kernel_table(title, kernels, total, unit):
    """The profile section's lines: a title with the whole time per unit, then a row per kernel."""
    lines = [f"{title}: {total:,.1f} µs a {unit} in all", f"  {f'µs/{unit}':>10} {f'calls/{unit}':>12}  share  kernel"]
    for k in kernels:
        name = k.name if len(k.name) <= 90 else k.name[:87] + "..."
        lines.append(f"  {k.us:10,.1f} {k.calls:12,.1f} {k.share:6.1%}  {name}")
    return "\n".join(lines)
