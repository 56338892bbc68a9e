"""
A pytest plugin (pytest.ini loads it with `-p workers`): the suite runs on every core, through pytest-xdist.

Most tests are small models stepped from Python: one process keeps one core busy and leaves the other idle (on 2
cores, 227 s of CPU in 203 s). So where pytest-xdist is installed (requirements-dev.txt) and the command line says
nothing of it, this adds `-n WORKERS --dist worksteal` (the tests are dealt out evenly, and a worker that runs out
takes the other's last ones: the long process tests do not pile up on one) and gives each worker an equal share of
the cores for torch's threads
(OMP_NUM_THREADS, unless set already: two workers of 2 threads on 2 cores wait on each other's spinning threads).
The processes the tests start inherit it. Where xdist is missing (a GPU machine with torch and pytest alone), with
`-n`/`-p no:xdist` given, for what needs one process (`--pdb`, `--trace`, `-s`, `--collect-only`), or for tests
named one by one (FILE::TEST: a worker's start-up, ~3 s, is more than they save), nothing changes: `python -m
pytest -q -n 0` runs the suite in one process.

Here and not in conftest.py: arguments can be changed only before they are parsed, in
pytest_load_initial_conftests, which pytest calls for plugins and never for conftest files. After collection, what
it imported is frozen out of the garbage collector's passes (pytest_collection_finish).
"""

import gc
import os

MOST_WORKERS = 8  # (more processes than that only multiply the collection's imports, ~12 s of CPU each)
ONE_PROCESS = ("-n", "--numprocesses", "--dist", "--pdb", "--trace", "-s", "--capture=no", "--co", "--collect-only")


def cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_load_initial_conftests(early_config, parser, args):
    """Add -n and --dist to args where xdist is loaded and nothing asks for one process."""
    said = any(arg == option or arg.startswith(option + ("=" if option.startswith("--") else ""))
               for arg in args for option in ONE_PROCESS)  # (-n4 and --dist=load too)
    chosen = any("::" in arg for arg in args)  # tests named one by one: fewer than workers' start-up is worth
    if said or chosen or not early_config.pluginmanager.hasplugin("xdist") or "PYTEST_XDIST_WORKER" in os.environ:
        return
    workers = min(cores(), MOST_WORKERS)
    if workers < 2:
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores() // workers)))
    args[:] = ["-n", str(workers), "--dist", "worksteal", *args]


# the files whose tests take longest (whole processes, torchrun, compiling), run first: a worker that finishes
# takes the other's last tests, and a long one left for the end would make the suite wait for it alone
FIRST = ("test_bench.py", "test_distributed.py", "test_conversations.py", "test_quantize.py", "test_gguf.py",
         "test_serve.py")


def pytest_collection_modifyitems(session, config, items):
    """The longest files' tests first (in FIRST's order), the others after, each file's own order kept."""
    def rank(item):
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        return FIRST.index(name) if name in FIRST else len(FIRST)
    items.sort(key=rank)


def pytest_collection_finish(session):
    """What collection imported (transformers, the openai client, the test modules: objects that live as long as
    the process) is moved out of the garbage collector's sight, and it runs less often: its full passes walked all
    of it again and again, freeing next to nothing (BENCHMARKS.md, machine B, the suite). Cycles are still
    collected, only later."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20000, 20, 20)
