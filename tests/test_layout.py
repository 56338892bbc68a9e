"""The shape of the code: the project's modules import each other as a tree (no cycle, lazy imports
included), model.py imports nothing of ours, and no function is longer than 60 lines."""

import ast

import pytest

from conftest import ROOT

MODULES = sorted(p.stem for p in ROOT.glob("*.py"))


def project_imports(name):
    """The project modules that module `name` imports anywhere in its source (inside functions too)."""
    tree = ast.parse((ROOT / f"{name}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(MODULES) - {name}


def find_cycle(graph):
    """A list of modules that import each other in a circle, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walker_finds_imports_at_any_depth_and_cycles():
    # the check itself, on a made-up graph and on this file's own kind of import
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert "convert" in project_imports("checkpoint") and "model" in project_imports("train")


def test_the_product_modules_import_each_other_as_a_tree():
    graph = {name: project_imports(name) for name in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_model_py_imports_nothing_of_the_project():
    assert project_imports("model") == set()


@pytest.mark.parametrize("name", MODULES)
def test_no_function_is_longer_than_60_lines(name):
    tree = ast.parse((ROOT / f"{name}.py").read_text(encoding="utf-8"))
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, f"{name}.py: {long}"
