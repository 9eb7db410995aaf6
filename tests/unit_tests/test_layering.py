"""The project's import layering, checked statically with `ast` over every source file of
megatron/, tools/, custom_args/ and pretrain_*.py:

- no import cycle among project modules (an import inside a function counts: it is still a
  dependency, only a later one);
- no module reaches another module's private (underscore) name, by `from X import _name` or
  by `X._name` on an imported module;
- megatron/ never imports tools/ (tools are scripts built on megatron, not a library of it).

It also holds the size limits of DESIGN.md (section 6, Style): no function in megatron/ over 60
lines, no file there over 600, and gpt_model.py, the model a reader starts from, under 300.

An edge goes to the module an import names (`from a.b import c` names a.b.c when that is a
module, else a.b); a package's __init__ is not added implicitly, so re-exports do not count
as cycles of their own.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("megatron", "tools", "custom_args")


def source_files():
    files = [path for folder in TOP_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]
    return files + sorted(ROOT.glob("pretrain_*.py"))


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class ProjectModules:
    """Maps what an import statement names to a project module. Scripts under tools/ put their
    own folder and tools/ itself on sys.path, so a bare `import trace_gaps` there may name a
    sibling file."""

    def __init__(self):
        self.paths = {module_name(path): path for path in source_files()}

    def search_prefixes(self, module):
        prefixes = [""]
        if module.startswith("tools."):
            prefixes += [module.rsplit(".", 1)[0] + ".", "tools."]
        return prefixes

    def resolve(self, importer, dotted):
        """The project module that `dotted` names from `importer`, longest match, or None."""
        for prefix in self.search_prefixes(importer):
            parts = (prefix + dotted).split(".")
            for end in range(len(parts), prefix.count("."), -1):
                name = ".".join(parts[:end])
                if name in self.paths:
                    return name
        return None

    def absolute(self, importer, node):
        """The dotted module a `from ... import` names, relative levels resolved."""
        if not node.level:
            return node.module
        package = importer.split(".")
        if self.paths[importer].name != "__init__.py":
            package = package[:-1]
        base = package[:len(package) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))


class ImportScan(ast.NodeVisitor):
    """One module's imports: the project modules it depends on, the local names bound to
    project modules, and every private name it takes from another module."""

    def __init__(self, modules, importer):
        self.modules, self.importer = modules, importer
        self.edges, self.bound, self.private_uses = set(), {}, []

    def visit_Import(self, node):
        for alias in node.names:
            target = self.modules.resolve(self.importer, alias.name)
            if target is None:
                continue
            self.edges.add(target)
            if alias.asname:
                self.bound[alias.asname] = target
            else:
                head = alias.name.split(".")[0]
                self.bound[head] = self.modules.resolve(self.importer, head) or target

    def visit_ImportFrom(self, node):
        source = self.modules.absolute(self.importer, node)
        for alias in node.names:
            target = self.modules.resolve(self.importer, f"{source}.{alias.name}")
            if target is not None and target.endswith("." + alias.name):
                self.edges.add(target)  # a submodule
                self.bound[alias.asname or alias.name] = target
            else:
                target = self.modules.resolve(self.importer, source)
                if target is None:
                    continue
                self.edges.add(target)
            if is_private(alias.name) and target != self.importer:
                self.private_uses.append(f"{self.importer}:{node.lineno} from {source} import {alias.name}")

    def check_attribute(self, node):
        owner = self.module_of(node.value)
        if owner is not None and owner != self.importer and is_private(node.attr):
            self.private_uses.append(f"{self.importer}:{node.lineno} {owner}.{node.attr}")

    def module_of(self, node):
        """The project module an expression like `pkg.sub` names, through this file's imports."""
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute):
            parent = self.module_of(node.value)
            if parent is not None and f"{parent}.{node.attr}" in self.modules.paths:
                return f"{parent}.{node.attr}"
        return None


def scan_all():
    modules = ProjectModules()
    scans = {}
    for name, path in modules.paths.items():
        scan = ImportScan(modules, name)
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = list(ast.walk(tree))
        for node in nodes:  # bind every import first: a function may use a module imported below it
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                scan.visit(node)
        for node in nodes:
            if isinstance(node, ast.Attribute):
                scan.check_attribute(node)
        scans[name] = scan
    return scans


def find_cycles(graph):
    """One concrete cycle per strongly connected component (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        components.append(set(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [cycle_in(graph, component) for component in components]


def cycle_in(graph, component):
    """A shortest path from the component's first member back to itself."""
    start = min(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for child in sorted(graph[path[-1]] & component):
            if child == start:
                return path + [start]
            if child not in seen:
                seen.add(child)
                paths.append(path + [child])
    raise AssertionError(f"no cycle through {start}")


def test_find_cycles_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    scans = scan_all()
    graph = {name: scan.edges - {name} for name, scan in scans.items()}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_private_names_of_other_modules():
    uses = [use for scan in scan_all().values() for use in scan.private_uses]
    assert not uses, "private names used from another module:\n" + "\n".join(uses)


def test_megatron_never_imports_tools():
    uses = [f"{name} imports {target}" for name, scan in scan_all().items() if name.startswith("megatron")
            for target in sorted(scan.edges) if target.startswith("tools")]
    assert not uses, "\n".join(uses)


MODEL_PACKAGES = ("megatron.core.models", "megatron.core.transformer", "megatron.core.tensor_parallel")
APPLIED_FROM_OUTSIDE = ("megatron.core.fp8", "megatron.core.precision")


def test_the_model_code_never_imports_fp8_or_the_precision_converter():
    """Precision is applied to a built model (precision/apply.py swaps the layers' GEMMs): the layers,
    the transformer and the models build plain GEMMs and import neither package."""
    uses = [f"{name} imports {target}" for name, scan in scan_all().items() if name.startswith(MODEL_PACKAGES)
            for target in sorted(scan.edges) if target.startswith(APPLIED_FROM_OUTSIDE)]
    assert not uses, "\n".join(uses)


# ---------------------------------------------------------------- size limits (DESIGN.md, section 6)
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600
GPT_MODEL = ROOT / "megatron" / "core" / "models" / "difflm" / "gpt_model.py"
MAX_GPT_MODEL_LINES = 300


def long_functions(source, limit):
    """(name, first line, lines) of every function or method over `limit` lines, decorators and
    docstring included; a nested function counts on its own and within its parent."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
            length = node.end_lineno - first + 1
            if length > limit:
                found.append((node.name, first, length))
    return found


def test_long_functions_reports_what_is_over_the_limit():
    body = "\n".join(f"        x{index} = {index}" for index in range(58))
    source = f"class A:\n    @property\n    def long(self):\n{body}\n\n    def short(self):\n        return 1\n"
    assert long_functions(source, 59) == [("long", 2, 60)], "the decorator line counts"
    assert long_functions(source, 60) == []
    nested = "def outer():\n    def inner():\n" + "\n".join(f"        y{i} = {i}" for i in range(5)) + "\n"
    assert long_functions(nested, 5) == [("outer", 1, 7), ("inner", 2, 6)]


def test_functions_fit_on_a_screen():
    too_long = [f"{path.relative_to(ROOT)}:{first} {name}: {length} lines"
                for path in sorted((ROOT / "megatron").rglob("*.py"))
                for name, first, length in long_functions(path.read_text(), MAX_FUNCTION_LINES)]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(too_long)


def test_files_stay_under_their_size_limits():
    lengths = {path: len(path.read_text().splitlines()) for path in sorted((ROOT / "megatron").rglob("*.py"))}
    assert lengths[GPT_MODEL] < MAX_GPT_MODEL_LINES, (
        f"gpt_model.py has {lengths[GPT_MODEL]} lines; move what is not the model's own job to its module "
        "(embedding.py, output_layer.py, objective.py, batch.py)")
    too_long = [f"{path.relative_to(ROOT)}: {lines} lines" for path, lines in lengths.items() if lines > MAX_FILE_LINES]
    assert not too_long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(too_long)
