"""The shape of the code: at the root only the commands and the model (every other module in machinery/, flat);
every module of ours imports the others as a tree (no cycle, lazy imports included); model.py imports nothing of
ours; no function is longer than 60 lines; README's machinery table names every file of machinery/, one a row."""

import ast
import re
import subprocess
import sys

import pytest

from conftest import ROOT

PACKAGE = "machinery"
# what a user runs or reads first: the model (and its optimizers, part of the model's story), and the commands
ROOT_MODULES = {"model", "optimizers", "train", "sample", "prepare", "eval", "export", "plot", "bench", "serve"}
MODULES = {p.stem: p for p in ROOT.glob("*.py")} | {f"{PACKAGE}.{p.stem}": p for p in (ROOT / PACKAGE).glob("*.py")
                                                     if p.stem != "__init__"}


def project_imports(name):
    """The modules of ours that module `name` imports anywhere in its source (inside functions too), by their
    dotted names: `from machinery import meta`, `import machinery.meta` and `from machinery.meta import x` all
    count as machinery.meta."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{name}: relative import; write `from {PACKAGE} import ...`")
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
    # the check itself, on a made-up graph and on this project's kinds of import
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert "machinery.convert" in project_imports("machinery.checkpoint")  # from machinery import convert
    assert "model" in project_imports("train")  # from model import GPT
    assert "machinery.errors" in project_imports("train")  # from machinery.errors import UserError


def test_every_module_imports_the_others_as_a_tree():
    graph = {name: project_imports(name) for name in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_model_py_imports_nothing_of_the_project():
    assert project_imports("model") == set()


def test_the_root_holds_the_commands_and_the_model_and_the_package_holds_the_rest():
    root = {p.stem for p in ROOT.glob("*.py")}
    assert root <= ROOT_MODULES and len(root) <= 10, sorted(root - ROOT_MODULES)
    for name in root - {"model", "optimizers"}:  # a command: a main(), run under `if __name__ == "__main__"`
        tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name
        assert any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body), name
    package = ROOT / PACKAGE
    assert (package / "__init__.py").is_file()
    assert not [p for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"]  # flat inside
    commands = root - {"model", "optimizers"}
    for name in [m for m in MODULES if m.startswith(f"{PACKAGE}.")]:  # the machinery is below the commands
        assert not project_imports(name) & commands, (name, project_imports(name) & commands)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_function_is_longer_than_60_lines(name):
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, f"{name}: {long}"


def readme_machinery_rows():
    """The first cells of README's machinery table (the table after the line that begins with `machinery/`)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"`{PACKAGE}/`"))
    rows = []
    for line in lines[start + 1:]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("|") and not line.startswith("| file") and not line.startswith("| ---"):
            rows.append(line.split("|")[1].strip())
    return rows


def test_the_readme_table_lists_each_file_of_the_machinery_once_a_row():
    # a file added, removed or renamed in machinery/ without its row would leave readers a wrong map
    rows = readme_machinery_rows()
    names = [re.findall(r"`([^`]+)`", row) for row in rows]
    assert all(len(n) == 1 for n in names), [row for row, n in zip(rows, names) if len(n) != 1]  # one job a row
    files = {p.name for p in (ROOT / PACKAGE).iterdir()
             if p.is_file() and p.name != "__init__.py" and not p.name.startswith(".")}
    listed = [n[0] for n in names]
    assert len(listed) == len(set(listed)) and set(listed) == files, (sorted(files - set(listed)),
                                                                      sorted(set(listed) - files))


def test_prepare_py_imports_no_torch():
    # prepare.py and its tokenizer workers do without torch (BENCHMARKS.md: the memory it cost), though dataset.py,
    # which it imports for the dataset's directory, also draws the training batches (importing torch inside)
    code = "import sys, prepare; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0
