"""Huge pages for the memory a process reads over and over: a model's weights while it decodes.

Every token reads every weight once (250 MB for GPT-2 124M in bfloat16), and with the usual 4 KB pages the CPU
looks up a new page's address every 4 KB, which in a virtual machine walks two page tables: with the weights in
2 MB pages a token's matrix products take about 0.87 of their time (BENCHMARKS.md). PyTorch can ask for huge pages
for all its large allocations (THP_MEM_ALLOC_ENABLE=1), but then every temporary and the KV cache are faulted in
2 MB at a time, and the start is slower. So only the weights are moved, once they are written, by Linux's
MADV_COLLAPSE (kernel 6.1 and later): the kernel copies each 2 MB of them into a huge page, the contents the same.
It is best effort: where the kernel cannot (another OS, an older kernel, huge pages turned off, no free memory),
the memory stays as it was.
"""

import collections
import ctypes
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

MADV_COLLAPSE = 25  # (linux/mman.h)
HUGE_PAGE = 2 << 20  # x86-64's and most of arm64's


def collapse(regions, threads=1):
    """Back with huge pages the memory of regions [(address, bytes)], where Linux can: each huge page that they
    fill at least half of (its other half some neighbour's memory, unchanged; some of it new, where the neighbour
    had not touched it yet), shared out among `threads` threads (each page's copy is the kernel's work on the
    calling thread: GPT-2 124M's 0.28-0.33 s in one, 0.13-0.16 s in two on BENCHMARKS.md's machine C); the bytes
    so backed."""
    madvise = _madvise()
    if madvise is None:
        return 0
    covered = collections.Counter()  # huge page -> bytes of it in regions
    for address, size in regions:
        for page in range(address // HUGE_PAGE * HUGE_PAGE, address + size, HUGE_PAGE):
            covered[page] += min(page + HUGE_PAGE, address + size) - max(page, address)
    pages = sorted(page for page, size in covered.items() if 2 * size >= HUGE_PAGE)

    def move(share):
        return HUGE_PAGE * sum(madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0 for page in share)

    if threads <= 1 or len(pages) <= 1:
        return move(pages)
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(move, (pages[i::threads] for i in range(threads))))


def collapse_in_background(regions):
    """collapse(regions) in a daemon thread (the kernel's copying runs beside the caller's work: 0.4 s of one core
    for GPT-2 124M on BENCHMARKS.md's machine C); the thread."""
    thread = threading.Thread(target=collapse, args=(list(regions),), name="huge pages", daemon=True)
    thread.start()
    return thread


def _madvise():
    """libc's madvise(address, length, advice) -> 0 or -1, or None where there is none to call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise
