"""The architecture's rules, checked on the source: contract names exist once, imports point one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from layerzero import contract

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compiler", "passes", "runtime", "plugins", "models")


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


def _string_constants(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


CONTRACT_LITERALS = sorted(
    {
        contract.RUNTIME_PREFIX,
        contract.MASK_PREFIX,
        contract.ROUTER_PREFIX,
        contract.THRESHOLD_INPUT,
        contract.FORCE_OFF_PREFIX,
        contract.BLOCK_PREFIX,
        contract.DYNAMIC_META_KEY,
        contract.REFUSED_META_KEY,
        contract.MOE_DOMAIN,
    }
)


@pytest.mark.parametrize("literal", CONTRACT_LITERALS)
def test_contract_names_exist_once(literal: str) -> None:
    # Outside the contract no string (docstrings aside) holds the name, not even inside a message; models/ builds
    # example graphs in the skipping form on purpose (an ONNX file written by hand) and is not checked.
    owners = [
        str(p.relative_to(ROOT))
        for p in _sources("compiler", "passes", "runtime", "plugins")
        if p.name != "contract.py" and any(literal in s for s in _string_constants(p))
    ]
    assert not owners, f"{literal!r} is spelled out in {owners}"
    defined = _string_constants(ROOT / "compiler" / "contract.py")
    assert literal in defined or literal.startswith(contract.RUNTIME_PREFIX)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", _sources("runtime"), ids=lambda p: p.name)
def test_runtime_imports_no_pass_and_no_target(path: Path) -> None:
    bad = sorted(
        n for n in _imports(path) if n.startswith(("layerzero.passes", "layerzero.targets", "layerzero.pipeline"))
    )
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", _sources("passes"), ids=lambda p: p.name)
def test_passes_import_no_target_backend_or_compiler(path: Path) -> None:
    allowed = ("layerzero.passes", "layerzero.contract", "layerzero.errors", "layerzero.ort_runner")
    bad = sorted(n for n in _imports(path) if n.startswith("layerzero") and not n.startswith(allowed))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_contract_is_a_leaf() -> None:
    ours = {n for n in _imports(ROOT / "compiler" / "contract.py") if n.startswith("layerzero")}
    assert not ours


def test_ort_runner_is_a_leaf() -> None:
    # Passes and the runtime both create their sessions with it: it may lean on errors and plugins only.
    ours = {n for n in _imports(ROOT / "compiler" / "ort_runner.py") if n.startswith("layerzero")}
    assert ours <= {"layerzero.errors", "layerzero.plugins", "layerzero.plugins.ort_library"}, ours


@pytest.mark.parametrize("folder", ["compiler", "passes", "runtime"])
def test_sessions_are_created_by_the_runner_only(folder: str) -> None:
    # One ORT runner: no other module builds an InferenceSession or its options.
    owners = [
        str(p.relative_to(ROOT))
        for p in _sources(folder)
        if p.name != "ort_runner.py"
        and any(w in p.read_text(encoding="utf-8") for w in ("InferenceSession(", "SessionOptions("))
    ]
    assert not owners, f"sessions are created outside layerzero.ort_runner in {owners}"


# The import package's folders (pyproject.toml ``package-dir``): a file's module name is its folder's, then its path.
_PACKAGE_DIRS = {
    "compiler": "layerzero",
    "passes": "layerzero.passes",
    "runtime": "layerzero.runtime",
    "plugins": "layerzero.plugins",
    "models": "layerzero.models",
}


def _module_names() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for folder, package in _PACKAGE_DIRS.items():
        for path in _sources(folder):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run, or are named for typing, at module level: the module's body and what its
    ``if`` (``TYPE_CHECKING`` included), ``try`` and ``with`` blocks hold; not function or class bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            pending.extend(node.body)
            pending.extend(getattr(node, "orelse", []))
            pending.extend(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                pending.extend(handler.body)
    return found


def _import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports at module level: line}; ``from a import b`` is ``a.b`` when that is one of
    ours, else ``a``; a relative import is resolved against the module's package."""
    modules = _module_names()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
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
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles() -> None:
    """No two of layerzero's modules import each other, directly or through others.

    Counted: every module-level import statement of every module of the package (``compiler/``, ``passes/``,
    ``runtime/``, ``plugins/``, ``models/``), those under ``if TYPE_CHECKING:`` included (a type a module names
    is a dependency too); an import inside a function is not counted (a lazy import: a heavy toolkit, or a
    call up to a higher layer such as ``Engine.generate``). An import names the most specific of our modules
    it reaches (``from layerzero.targets.registry import TARGETS`` is ``layerzero.targets.registry``).
    """
    graph = _import_graph()
    assert "layerzero.compile" in graph and "layerzero.runtime.engine" in graph  # the mapping found the modules
    circles = _cycles(graph)
    described = [
        "; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in circle for b in sorted(graph[a]) if b in circle)
        for circle in circles
    ]
    assert not circles, f"import circles: {described}"


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


#: Modules over MAX_LINES today (none: a module that grows past it is split by meaning, e.g. a router variant a file).
LONG_MODULES: set[str] = set()
MAX_LINES = 600


def test_pass_and_runtime_modules_stay_short() -> None:
    lengths = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in _sources("passes", "runtime")
    }
    long = sorted(f"{p} ({n} lines)" for p, n in lengths.items() if n > MAX_LINES and p not in LONG_MODULES)
    assert not long, f"over {MAX_LINES} lines: {long}; split the module"
    unknown = sorted(LONG_MODULES - set(lengths))
    assert not unknown, f"LONG_MODULES names modules that do not exist: {unknown}"


#: Modules that still cite the design note that is not in the repository (helper "static" is rewriting them).
_CITES_MISSING_DESIGN_NOTE = {"passes/_lattice.py", "passes/_rows.py", "passes/_shapes.py"}


def test_no_module_refers_to_a_missing_design_note() -> None:
    # docs/architecture.md is the one design document; the note spelled below is not in the repository.
    missing = "DESIGN" + ".md"
    assert not (ROOT / missing).exists()
    citing = sorted(
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if not {".venv", "build"} & set(p.relative_to(ROOT).parts)
        and missing in p.read_text(encoding="utf-8")
        and str(p.relative_to(ROOT)) not in _CITES_MISSING_DESIGN_NOTE
    )
    assert not citing, f"{citing} cite {missing}, which is not in the repository (docs/architecture.md is)"


def _flags_defined(path: Path) -> set[str]:
    """The ``--flags`` a module's ``add_argument`` calls define."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--")
    }


#: A verb's flag that shares a shared flag's name but means something else: (module, flag).
_SAME_NAME_OTHER_MEANING = {
    ("generate.py", "--max-tokens"),  # where generation stops (prompt included), not the guard's routing bound
}


def test_shared_cli_flags_have_one_definition() -> None:
    # A flag compiler/cli/_common.py defines (--force, --device, --moe-lowering, the guard's, ...) is defined
    # nowhere else: every verb that has it calls the shared definition.
    shared = _flags_defined(ROOT / "compiler" / "cli" / "_common.py")
    assert {"--force", "--device", "--moe-lowering", "--impact-tolerance", "--reference"} <= shared
    again = {
        p.name: flags
        for p in _sources("compiler/cli")
        if p.name != "_common.py"
        and (flags := sorted(f for f in _flags_defined(p) & shared if (p.name, f) not in _SAME_NAME_OTHER_MEANING))
    }
    assert not again, f"defined again outside compiler/cli/_common.py: {again}"


#: Modules that still import another module's private name (being split: the lead shrinks this list).
_IMPORTS_PRIVATE_NAMES: set[str] = set()


def _private_imports(path: Path) -> list[str]:
    """``module.name`` for each ``from layerzero... import _name`` in a file (any level: functions too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("layerzero")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_no_module_imports_another_modules_private_name() -> None:
    # A name another module needs is public (in its __all__); a private one is the module's own business.
    found = {
        str(p.relative_to(ROOT)): names
        for p in _sources(*PACKAGES)
        if str(p.relative_to(ROOT)) not in _IMPORTS_PRIVATE_NAMES and (names := _private_imports(p))
    }
    assert not found, f"private names imported across modules: {found}"


def test_the_private_import_finder_finds_one(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from layerzero.runtime.generate import _x, y\n")
    assert _private_imports(source) == ["layerzero.runtime.generate._x"]


# Files that build a raw ir.Node(...) where the builder cannot (each with why; none today: every pass builds on
# passes/_builder.Builder, MoENode.to_node on its own tape).
RAW_NODE_ALLOWED: set[str] = set()


def _raw_node_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "Node"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "ir"
    ]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_passes_build_nodes_with_the_builder() -> None:
    # One node builder (passes/_builder.py, on ir.tape.Tape): unique names, opset-aware forms. No raw ir.Node(...)
    # outside RAW_NODE_ALLOWED.
    raw = {
        f"{_rel(p)}:{line}"
        for p in _sources("passes")
        if _rel(p) not in RAW_NODE_ALLOWED
        for line in _raw_node_calls(p)
    }
    assert not raw, f"ir.Node(...) built outside passes/_builder.Builder at {sorted(raw)}"


def test_passes_take_typed_arguments_not_options() -> None:
    owners = [_rel(p) for p in _sources("passes") if "getattr(options" in p.read_text(encoding="utf-8")]
    assert not owners, f"passes read an options object in {owners}; take the typed values in the constructor"


# Failure classes of files being moved onto passes/_match.NoMatch now.
FAILURE_CLASS_ALLOWED: set[str] = set()


def test_passes_have_one_failure_type() -> None:
    # passes/_match.NoMatch is the one "does not apply"; errors of the input are layerzero.errors.
    found = []
    for p in _sources("passes"):
        if _rel(p) in FAILURE_CLASS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if bases & {"Exception", "BaseException", "ValueError", "RuntimeError", "LookupError", "KeyError"} or any(
                b.endswith(("Error", "Exception")) for b in bases
            ):
                found.append((_rel(p), node.name))
    assert found == [("passes/_match.py", "NoMatch")], f"failure classes other than passes/_match.NoMatch: {found}"


# What marks an evaluator of shapes / integer vectors: a function or a module-level table whose strings (its own,
# and those of the module's tables it names) spell Shape, Gather and Concat with integer arithmetic.
_VECTOR_MARKS = frozenset({"Shape", "Gather", "Concat"})
_VECTOR_ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div"})
#: The one evaluator: SymbolicShapes' dims rule and the op table of its integer vectors.
EVALUATOR = {"passes/_shapes.py": ["_rule"], "passes/_shape_rules.py": ["VECTOR_RULES"]}


def _evaluators(path: Path) -> list[str]:
    """Names of the module-level tables and the functions of a file that spell an evaluator's ops."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def strings(node: ast.AST) -> set[str]:
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}

    def marks(found: set[str]) -> bool:
        return found >= _VECTOR_MARKS and len(_VECTOR_ARITHMETIC & found) >= 2

    tables: dict[str, set[str]] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name):
            tables[target.id] = strings(node)
    found = [name for name, spelled in tables.items() if marks(spelled)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            named = {s for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in tables for s in tables[n.id]}
            if marks(strings(node) | named):
                found.append(node.name)
    return found


def test_one_shape_and_integer_vector_evaluator() -> None:
    # Shapes, bounds and sizes computed as integer vectors are evaluated by passes/_shapes.SymbolicShapes on the
    # rules of passes/_shape_rules.py: a pass asks it (SymbolicShapes().ints / .static_vector / .vector / .dims)
    # instead of following Shape / Gather / Concat / Add ... itself.
    found = {_rel(p): names for p in _sources("passes") if (names := _evaluators(p))}
    assert found == EVALUATOR, f"evaluators of shapes / integer vectors outside SymbolicShapes: {found}"


def test_the_evaluator_finder_finds_one(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "ARITHMETIC = {'Add': 1, 'Mul': 2}\n"
        "def ints(node):\n"
        "    if node.op_type == 'Shape': return dims\n"
        "    if node.op_type in ('Gather', 'Concat'): return parts\n"
        "    return ARITHMETIC[node.op_type]\n"
        "OPS = frozenset({'Shape', 'Gather', 'Concat', 'Sub', 'Div'})\n"
    )
    assert _evaluators(source) == ["OPS", "ints"]
