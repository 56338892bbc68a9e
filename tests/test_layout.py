"""The shape of the code: at the root only the commands and the model; every other module in machinery/ (what the
commands share: the shared basics, then its wings, each flat, importing only the basics and the wings WINGS allows) or
benchmarks/ (what bench.py alone uses, flat); every module of ours imports the others as a tree (no cycle, lazy
imports included), the machinery never a benchmark; model.py imports nothing of ours (but GPT-2's files' reader, in
GPT.from_pretrained); the files stay readable in size (SIZES) and no function is longer than 60 lines; a machinery
module's docstring says what it owns in at most DOCSTRING_LINES lines; README's file tree names every file of both
packages, a line each."""

import ast
import subprocess
import sys

import pytest

from conftest import ROOT

MACHINERY, BENCHMARKS = "machinery", "benchmarks"
PACKAGES = (MACHINERY, BENCHMARKS)
# what a user runs or reads first: the model (and its optimizers, part of the model's story), and the commands
ROOT_MODULES = {"model", "optimizers", "train", "sample", "prepare", "eval", "export", "plot", "bench", "serve"}
# machinery's wings, in order: the wings each may import, besides the shared basics (machinery/*.py, which import no wing)
WINGS = {"data": set(), "weights": {"data"}, "training": {"data", "weights"}, "generation": {"data", "weights"},
         "serving": {"data", "weights", "generation"}}
MODULES = {p.stem: p for p in ROOT.glob("*.py")} | {
    ".".join(p.relative_to(ROOT).with_suffix("").parts): p
    for p in [*(ROOT / BENCHMARKS).glob("*.py"), *(ROOT / MACHINERY).glob("*.py"), *(ROOT / MACHINERY).glob("*/*.py")]
    if p.stem != "__init__"}
# the most lines a file may hold: the model and the loop as a learner reads them beside nanoGPT's (~330 lines each)
SIZES = {"model": 400, "train": 450, MACHINERY: 600}
# a machinery module's docstring: what it owns and what it does not (figures and history live in BENCHMARKS.md)
DOCSTRING_LINES = 12
COMMANDS = {name for name in MODULES if "." not in name} - {"model", "optimizers"}


def package_modules(package):
    """The dotted names of the modules of one of our packages (machinery.data.meta, ...)."""
    return sorted(name for name in MODULES if name.startswith(f"{package}."))


def imported_names(name):
    """Every dotted name that module `name` imports anywhere in its source (inside functions too), ours or not:
    `from machinery import meta`, `import machinery.data.meta` and `from machinery.data.meta import x` all give
    machinery.data.meta (and machinery)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{name}: relative import; write `from {name.split('.')[0]} import ...`")
    return found


def project_imports(name):
    """The modules of ours that module `name` imports, by their dotted names (see imported_names)."""
    return imported_names(name) & set(MODULES) - {name}


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


def reached(starts, graph, avoid):
    """The modules that those of starts import, directly or through others, never by way of a module of avoid."""
    found, todo = set(), list(starts)
    while todo:
        for nxt in graph[todo.pop()] - avoid - found:
            found.add(nxt)
            todo.append(nxt)
    return found


def test_the_walker_finds_imports_at_any_depth_and_cycles():
    # the check itself, on a made-up graph and on this project's kinds of import
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert "machinery.weights.lora" in project_imports("machinery.weights.checkpoint")  # from machinery import lora
    assert "model" in project_imports("train")  # from model import GPT
    assert "machinery.errors" in project_imports("train")  # from machinery.errors import UserError
    assert "benchmarks.runs" in project_imports("benchmarks.chat")  # from benchmarks.runs import setting_args
    assert "benchmarks.serve" in project_imports("bench")  # from benchmarks.serve import bench_serve
    graph = {"train": {"m.a"}, "m.a": {"m.b"}, "m.b": set(), "bench": {"m.c", "m.a"}, "m.c": {"m.d"}, "m.d": set()}
    assert reached({"train"}, graph, avoid={"bench"}) == {"m.a", "m.b"}
    assert reached({"bench"}, graph, avoid={"m.a"}) == {"m.c", "m.d"}  # at any depth, never through m.a


def test_every_module_imports_the_others_as_a_tree():
    graph = {name: project_imports(name) for name in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_model_py_imports_nothing_of_the_project_but_gpt2_s_files_in_from_pretrained():
    # model.py stands alone: its one import of ours, machinery.gpt2_weights, is inside GPT.from_pretrained only, and
    # gpt2_weights imports nothing of ours but machinery.errors (so model.py never reaches the rest, and no cycle)
    assert project_imports("model") == {"machinery.gpt2_weights"}
    tree = ast.parse(MODULES["model"].read_text(encoding="utf-8"))
    where = [".".join(scope) for scope, node in walk_scopes(tree)
             if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == MACHINERY
             or isinstance(node, ast.Import) and any(a.name.split(".")[0] == MACHINERY for a in node.names)]
    assert where == ["GPT.from_pretrained"], where
    assert project_imports("machinery.gpt2_weights") <= {"machinery.errors"}


def walk_scopes(node, scope=()):
    """(the names of the classes and functions around it, node) of every node under node."""
    for child in ast.iter_child_nodes(node):
        inner = scope + (child.name,) if isinstance(child, (ast.ClassDef, ast.FunctionDef)) else scope
        yield scope, child
        yield from walk_scopes(child, inner)


def test_the_root_holds_the_commands_and_the_model_and_the_packages_hold_the_rest():
    root = {p.stem for p in ROOT.glob("*.py")}
    assert root <= ROOT_MODULES and len(root) <= 10, sorted(root - ROOT_MODULES)
    for name in root - {"model", "optimizers"}:  # a command: a main(), run under `if __name__ == "__main__"`
        tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name
        assert any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body), name
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file()
        folders = {p.name for p in (ROOT / package).iterdir() if p.is_dir() and p.name != "__pycache__"}
        assert folders == (set(WINGS) if package == MACHINERY else set()), folders  # the benchmarks flat
        for name in package_modules(package):  # the machinery and the benchmarks are below the commands
            assert not project_imports(name) & COMMANDS, (name, project_imports(name) & COMMANDS)
    for wing in WINGS:  # each wing flat, a package saying what it owns
        assert (ROOT / MACHINERY / wing / "__init__.py").read_text(encoding="utf-8").startswith('"""'), wing
        assert not [p for p in (ROOT / MACHINERY / wing).iterdir() if p.is_dir() and p.name != "__pycache__"], wing


def wing_of(name):
    """The wing of a module of machinery (machinery.data.meta -> data), "" for a shared basic, None elsewhere."""
    parts = name.split(".")
    return None if parts[0] != MACHINERY else parts[1] if len(parts) == 3 else ""


def test_each_wing_imports_only_the_basics_and_the_wings_below_it():
    assert wing_of("machinery.data.meta") == "data" and wing_of("machinery.errors") == "" and wing_of("train") is None
    for name in package_modules(MACHINERY):
        wings = {wing_of(n) for n in project_imports(name) if n != "model"} - {"", None}
        allowed = WINGS.get(wing_of(name), set()) | {wing_of(name)} - {""}
        assert wings <= allowed, (name, sorted(wings - allowed))


def test_the_files_stay_the_size_a_reader_takes_in():
    for name, path in MODULES.items():
        most = SIZES.get(name, SIZES[MACHINERY] if wing_of(name) is not None else None)
        if most:
            assert len(path.read_text(encoding="utf-8").splitlines()) <= most, name
    # the scheduler alone: what runs the model, the requests' types and the CPU's layers are owners of their own
    tree = ast.parse(MODULES["machinery.generation.engine"].read_text(encoding="utf-8"))
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert engine.end_lineno - engine.lineno + 1 <= 300


def test_the_machinery_never_imports_the_benchmarks():
    # the benchmarks measure the machinery: were it to import one, every command would load bench.py's code
    for name in package_modules(MACHINERY):
        wrong = {n for n in imported_names(name) if n == BENCHMARKS or n.startswith(f"{BENCHMARKS}.")}
        assert not wrong, (name, sorted(wrong))


def test_the_machinery_holds_only_what_the_commands_share():
    # a module that only bench.py and the benchmarks use is a benchmark: it belongs in benchmarks/. Each module of
    # machinery/ is imported by a command other than bench.py, or by a module that is, and so on (never by way
    # of bench.py or a benchmark)
    machinery = package_modules(MACHINERY)
    assert not [name for name in machinery if name.split(".")[1].startswith("bench")]
    graph = {name: project_imports(name) for name in MODULES}
    used = reached(COMMANDS - {"bench"}, graph, avoid={"bench", *package_modules(BENCHMARKS)})
    assert set(machinery) <= used, sorted(set(machinery) - used)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_function_is_longer_than_60_lines(name):
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, f"{name}: {long}"


@pytest.mark.parametrize("name", package_modules(MACHINERY))
def test_each_machinery_module_says_what_it_owns_in_at_most_12_lines(name):
    docstring = ast.get_docstring(ast.parse(MODULES[name].read_text(encoding="utf-8")))
    assert docstring, f"{name} has no docstring"
    lines = len(docstring.strip().splitlines())
    assert lines <= DOCSTRING_LINES, f"{name}: a docstring of {lines} lines (at most {DOCSTRING_LINES})"


def tree_paths(text):
    """The paths of a file tree (the code block under `## What is where`), a line each, in order: `name  what it
    owns`; a name ending in / opens a folder, and the lines under it, indented two spaces more, are in it, at any
    depth (`machinery/`, `  data/`, `    meta.py`: machinery/data/meta.py). A folder's path keeps its /."""
    lines = text.splitlines()
    start = lines.index("## What is where")
    first, last = [i for i in range(start, len(lines)) if lines[i].startswith("```")][:2]
    paths, folders = [], []
    for line in lines[first + 1:last]:
        depth, odd = divmod(len(line) - len(line.lstrip(" ")), 2)
        assert not odd and depth <= len(folders), f"two spaces more a folder deep: {line!r}"
        name, *what = line.split(maxsplit=1)
        assert what, f"a line names a path and what it owns: {line!r}"
        folders = folders[:depth]
        paths.append("/".join([*folders, name]))
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
    return paths


def readme_tree():
    """The paths of README's file tree (tree_paths)."""
    return tree_paths((ROOT / "README.md").read_text(encoding="utf-8"))


def files_under(folder):
    """Every file beneath a folder, at any depth, as a path from the root: no __init__.py, caches or dotfiles."""
    found = {p.relative_to(ROOT) for p in (ROOT / folder).rglob("*") if p.is_file() and p.name != "__init__.py"}
    return {p.as_posix() for p in found if not any(part.startswith(".") or part == "__pycache__" for part in p.parts)}


def test_the_tree_reader_maps_each_line_to_its_path_at_any_depth():
    # the reader itself, on the lines a package's sub-folder takes
    text = "\n".join(["## What is where", "", "```", "model.py      the model", "machinery/    shared",
                      "  data/       datasets", "    meta.py   meta.json", "  errors.py   errors",
                      "config/       presets", "```"])
    assert tree_paths(text) == ["model.py", "machinery/", "machinery/data/", "machinery/data/meta.py",
                                "machinery/errors.py", "config/"]
    with pytest.raises(AssertionError):
        tree_paths(text.replace("    meta.py", "      meta.py"))  # deeper than the folder above it
    with pytest.raises(AssertionError):
        tree_paths(text.replace("  errors.py   errors", "  errors.py"))  # without what it owns


@pytest.mark.parametrize("package", PACKAGES)
def test_the_readme_tree_lists_each_file_of_a_package_once_a_line(package):
    # a file added, removed or renamed in machinery/ or benchmarks/ (a sub-folder's too) without its line would
    # leave readers a wrong map
    paths = readme_tree()
    listed = [p for p in paths if p.startswith(f"{package}/") and not p.endswith("/")]
    files = files_under(package)
    assert f"{package}/" in paths
    assert len(listed) == len(set(listed)), sorted(p for p in set(listed) if listed.count(p) > 1)
    assert set(listed) == files, (sorted(files - set(listed)), sorted(set(listed) - files))  # (missing, extra)


def test_the_readme_tree_names_real_paths_the_commands_and_each_folder_it_opens_whole():
    paths = readme_tree()
    assert len(paths) == len(set(paths)), sorted(p for p in set(paths) if paths.count(p) > 1)
    wrong = [p for p in paths if not ((ROOT / p).is_dir() if p.endswith("/") else (ROOT / p).is_file())]
    assert not wrong, wrong
    root = {p.name for p in ROOT.glob("*.py")}  # the model and every command
    assert root <= set(paths), sorted(root - set(paths))
    for folder in [p for p in paths if p.endswith("/")]:  # a folder whose files the tree lists, it lists whole
        listed = {p for p in paths if p.startswith(folder) and not p.endswith("/")}
        assert not listed or listed == files_under(folder), (folder, sorted(files_under(folder) - listed),
                                                             sorted(listed - files_under(folder)))


def test_prepare_py_imports_no_torch():
    # prepare.py and its tokenizer workers do without torch (BENCHMARKS.md: the memory it cost), though dataset.py,
    # which it imports for the dataset's directory, also draws the training batches (importing torch inside)
    code = "import sys, prepare; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0
