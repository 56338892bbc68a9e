"""Importing torch with Python's garbage collector paused: the commands that use torch import this module before
anything that imports torch, and every start is a tenth of a second or more shorter (BENCHMARKS.md).

Importing torch makes some hundreds of thousands of objects (its modules, functions, operator registrations),
and all of them live as long as the process. The collector runs every 700 new objects and walks the young ones
again each time, the older ones now and then: work that frees nothing here. So it is paused for the import, and
what the import made is then moved out of its sight (gc.freeze: else its next runs walk all of it, a tenth of a
second); it then runs as before on what comes after (a caller that had it off keeps it off)."""

import gc

_collecting = gc.isenabled()
gc.disable()
try:
    import torch  # noqa: F401
finally:
    gc.freeze()
    if _collecting:
        gc.enable()
