"""A native library's work in a child process of its own: a crash there (SIGILL from an instruction this CPU
lacks, SIGSEGV) fails the one test that asked, with one line naming the library and the signal, and every other
test still runs. (llama.cpp built with its AMX kernels dies of SIGILL on some Intel Xeons; in this process it
would take the whole pytest run down with it.)"""

import multiprocessing
import signal
import traceback

import pytest

START = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this process's threads or state


def in_child(library, function, *args, timeout=300):
    """function(*args) (a module-level function: the child imports it by name, not this test module) run in a
    child process; its return value (pickled back). pytest.fail, one line, where the child dies of a signal or
    does not answer within timeout seconds; an exception in the child is raised here as a RuntimeError carrying
    the child's traceback."""
    receive, send = START.Pipe(duplex=False)
    child = START.Process(target=_answer, args=(send, function, args), daemon=True)
    child.start()
    send.close()  # (the child's end, closed here: a child that dies makes receive see the end of the pipe)
    try:
        if not receive.poll(timeout):
            child.kill()
            pytest.fail(f"{library} did not answer within {timeout} s (child process {child.pid})", pytrace=False)
        try:
            answer = receive.recv()
        except EOFError:  # it died before answering
            answer = None
    finally:
        receive.close()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join(timeout=30)
    if answer is None:
        pytest.fail(f"{library} crashed the process it ran in: {died_of(child.exitcode)}", pytrace=False)
    ok, value = answer
    if not ok:
        raise RuntimeError(f"{library}, in a child process, raised:\n{value}")
    return value


def died_of(exitcode):
    """How a process ended, from its multiprocessing exit code (-N: killed by signal N)."""
    if exitcode is not None and exitcode < 0:
        signum = -exitcode
        name = signal.Signals(signum).name if signum in signal.valid_signals() else f"signal {signum}"
        return f"killed by {name} ({signal.strsignal(signum)})"
    return f"exit status {exitcode} without an answer"


def _answer(send, function, args):
    try:
        answer = (True, function(*args))
    except BaseException:  # (the traceback as text: the exception itself may not pickle)
        answer = (False, traceback.format_exc())
    send.send(answer)
    send.close()
