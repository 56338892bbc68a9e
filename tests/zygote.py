"""
A warm Python that forks: it imports the modules named on its command line once, then starts each script it is
asked for as a child forked from itself, so that a test that needs a script's own process (separate ranks joined
over gloo, an exit status, a signal, torchrun's agent) does not pay Python's and torch's start-up in every process
(~2.5 s for train.py's imports on 2 cores). conftest.Zygote is the test's side:

    python tests/zygote.py --runtime=NAME,NAME,... MODULE ...

prints "ready", then answers each line on stdin, {"argv": [script, arg, ...] or ["-m", module, arg, ...],
"env": {...}, "cwd": DIR, "stdout": FILE, "stderr": FILE}, with "started PID", and later, when that child has
ended, "exited PID STATUS" (Popen.returncode's: -N for signal N). At the end of stdin it kills its children, exits.

A child runs the script as `python script arg ...` (or `python -m module arg ...`) would: in the environment and
directory asked for, sys.argv and sys.path[0] as Python sets them, stdin /dev/null, stdout and stderr into the
files; the script runs as __main__ (runpy: a module run so is not to be among those imported first), and the
child ends through the interpreter's own exit (SystemExit, an uncaught exception, a signal: atexit, finalisation,
the exit status). What differs from a new process is only that the imports were made before, under this
process's environment: so a request may differ from it only in the variables named by --runtime (read when the
script runs, not at import), and is refused otherwise. The imports start no thread (checked before every fork: a
fork copies only the thread that calls it).
"""

import json
import os
import runpy
import selectors
import signal
import sys
import threading

PATH = list(sys.path)  # as Python set it up, before any import added to it
ENV = dict(os.environ)  # as it was given, before any import changed it (torch's sets TORCHINDUCTOR_CACHE_DIR)


def say(line):
    os.write(OUT, (line + "\n").encode())


def refusal(request, runtime):
    """Why request cannot be forked from here (None: it can)."""
    env = request["env"]
    changed = sorted(k for k in set(env) | set(ENV) if env.get(k) != ENV.get(k) and k not in runtime)
    if changed:
        return f"environment differs in {', '.join(changed)}, which the imports may have read"
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        return "this process runs threads: a fork would copy their locks, not them"
    return None


def child(request, runtime, files, selector, siblings):
    """In the forked child: become `python script args` with the request's environment and files; run it."""
    selector.close()
    for fd in [OUT, *siblings]:
        os.close(fd)
    for fd, opened in enumerate([os.open(os.devnull, os.O_RDONLY), *files]):
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    for name in runtime:  # (the rest is as the imports left it, as in a new process that made them)
        if name in request["env"]:
            os.environ[name] = request["env"][name]
        else:
            os.environ.pop(name, None)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (Python's own; this process ignores it)
    argv = request["argv"]
    if argv[0] == "-m":  # python -m MODULE arg ...: sys.path[0] the directory it runs in, sys.argv[0] the module's file
        sys.argv, sys.path[:] = argv[1:], [os.getcwd()] + PATH[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[:] = list(argv), [os.path.dirname(os.path.abspath(argv[0]))] + PATH[1:]
        runpy.run_path(argv[0], run_name="__main__")
    # falling off the end of the script: leave as the interpreter would, without returning to serve()
    raise SystemExit(0)


def fork(request, runtime, selector, children):
    """Start request's child; its pid. Its output files are opened here, before the fork (a FIFO's open waits for
    its reader: the test opened it before it asked)."""
    files = [os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in ("stdout", "stderr")]
    pid = os.fork()
    if pid == 0:
        child(request, runtime, files, selector, children)  # (never returns: it ends where a script's process ends)
    for fd in files:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pidfd] = pid
    selector.register(pidfd, selectors.EVENT_READ)
    return pid


def serve(runtime):
    """Fork a child for each request on stdin; report each one's start and end."""
    selector, pending, children = selectors.DefaultSelector(), b"", {}
    selector.register(0, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fd in children:  # a child has ended
                pid = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                say(f"exited {pid} {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}")
                continue
            data = os.read(0, 1 << 16)
            if not data:
                for pid in children.values():
                    os.kill(pid, signal.SIGKILL)
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if (why := refusal(request, runtime)) is not None:
                    say(f"refused {why}")
                    continue
                pid = fork(request, runtime, selector, children)
                say(f"started {pid}")


if __name__ == "__main__":
    OUT = os.dup(1)  # the replies (a child's stdout is its file)
    runtime = set(sys.argv[1].removeprefix("--runtime=").split(",")) - {""}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the test run is the test's to handle
    sys.path.insert(1, os.path.dirname(sys.path[0]))  # (the modules are found in tests/ and the repository's root)
    for module in sys.argv[2:]:
        __import__(module)
    say("ready")
    serve(runtime)
