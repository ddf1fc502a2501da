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


# Files whose nodes are not built with passes/_builder.Builder yet (the lead shrinks this list).
RAW_NODE_ALLOWED = {
    "passes/structured_zeros.py",
    "passes/uniform_propagation.py",
    "passes/constant_folding.py",
    "passes/_shapes.py",
    "passes/lower_tensorrt.py",
}


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
    # outside the files not converted yet.
    raw = {
        f"{_rel(p)}:{line}"
        for p in _sources("passes")
        if _rel(p) not in RAW_NODE_ALLOWED and not _rel(p).startswith("passes/_moe/")
        for line in _raw_node_calls(p)
    }
    assert not raw, f"ir.Node(...) built outside passes/_builder.Builder at {sorted(raw)}"


def test_passes_take_typed_arguments_not_options() -> None:
    owners = [_rel(p) for p in _sources("passes") if "getattr(options" in p.read_text(encoding="utf-8")]
    assert not owners, f"passes read an options object in {owners}; take the typed values in the constructor"


# Failure classes of files being moved onto passes/_match.NoMatch now.
FAILURE_CLASS_ALLOWED = {"passes/_moe/walk.py", "passes/structured_zeros.py"}


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
