"""tests/workers.py, the plugin that runs the suite on every core: when it adds pytest-xdist's workers, how many,
and the threads it gives each; when it leaves the command line alone."""

from types import SimpleNamespace

import pytest

import workers


def early_config(plugins):
    return SimpleNamespace(pluginmanager=SimpleNamespace(hasplugin=lambda name: name in plugins))


def decided(monkeypatch, args, cores=2, plugins=("xdist",), environ=None):
    """(args after the hook, OMP_NUM_THREADS after it) for a machine of cores, with environ."""
    monkeypatch.setattr(workers, "cores", lambda: cores)
    for name in ("OMP_NUM_THREADS", "PYTEST_XDIST_WORKER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (environ or {}).items():
        monkeypatch.setenv(name, value)
    args = list(args)
    workers.pytest_load_initial_conftests(early_config(plugins), None, args)
    return args, workers.os.environ.get("OMP_NUM_THREADS")


@pytest.mark.parametrize("cores, expected_workers, threads", [(2, 2, "1"), (3, 3, "1"), (16, 8, "2"), (64, 8, "8")])
def test_a_worker_a_core_up_to_8_each_with_its_share_of_the_cores(monkeypatch, cores, expected_workers, threads):
    args, omp = decided(monkeypatch, ["-q", "tests/test_model.py"], cores)
    assert args == ["-n", str(expected_workers), "--dist", "worksteal", "-q", "tests/test_model.py"]
    assert omp == threads


def test_threads_set_by_the_user_are_kept(monkeypatch):
    assert decided(monkeypatch, ["-q"], 2, environ={"OMP_NUM_THREADS": "2"}) == (
        ["-n", "2", "--dist", "worksteal", "-q"], "2")


@pytest.mark.parametrize("args", [["-n", "0"], ["-n0"], ["-n", "4"], ["--numprocesses=3"], ["--dist", "load"],
                                  ["--dist=loadfile"], ["--pdb"], ["--trace"], ["-s"], ["--capture=no"],
                                  ["--co"], ["--collect-only", "-q"], ["tests/test_model.py::test_forward"],
                                  ["tests/test_a.py", "tests/test_b.py::test_c[x]"]])
def test_a_command_line_that_says_how_to_run_is_left_alone(monkeypatch, args):
    assert decided(monkeypatch, ["-q", *args]) == (["-q", *args], None)


@pytest.mark.parametrize("cores, plugins, environ", [
    (1, ("xdist",), {}),  # one core: one process
    (2, (), {}),  # xdist not installed, or -p no:xdist, or plugin autoloading turned off
    (2, ("xdist",), {"PYTEST_XDIST_WORKER": "gw0"}),  # a worker itself
])
def test_nothing_changes_where_workers_cannot_help(monkeypatch, cores, plugins, environ):
    assert decided(monkeypatch, ["-q"], cores, plugins, environ) == (["-q"], None)
