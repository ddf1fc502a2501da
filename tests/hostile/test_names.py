"""Hostile names (issue 20): every name LayerZero adds or reserves may already be in a user's model.

For each dynamic pass that adds names (a gated branch, a MoE block, group masks) the suite compiles the clean model
once and takes every name the compile added (values, initializers, nodes, subgraphs, graph inputs and outputs,
metadata keys) plus the contract's reserved names (``layerzero.contract``: ``layerzero::mask::<path>``,
``::router::``, ``::threshold``, ``::force_off::``, ``::block::``, the metadata keys). It then plants those names
in the model, one place at a time (graph input, graph output, value, initializer, node name, metadata key, a
subgraph's value), and compiles again. The result must be a correct compile (verification passes, the user's
outputs keep their names, every graph's names are unique) or a one-line ``InvalidInputError`` naming the name
(exit 2 from the CLI): never a verification failure or a traceback.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from layerzero import contract
from layerzero.compile import compile_model
from layerzero.errors import InvalidInputError
from layerzero.models import build_gated_model, build_routed_example
from layerzero.models.moe import MoEConfig, build_moe
from layerzero.options import CompileOptions

KINDS = ("gate", "token-gate", "moe", "group")
PLACES = ("value", "initializer", "node", "output", "input", "metadata", "subgraph")


@functools.cache
def _case(kind: str, tmp: str) -> SimpleNamespace:
    """The clean model of a dynamic pass, its options, and its dynamic path."""
    if kind == "gate":
        return SimpleNamespace(proto=build_gated_model("scalar"), options=CompileOptions(), path="layers.0.mlp")
    if kind == "token-gate":
        return SimpleNamespace(proto=build_gated_model("token"), options=CompileOptions(), path="layers.0.mlp")
    if kind == "moe":
        proto = build_moe(MoEConfig(hidden=16, ffn=32, experts=4, top_k=2))
        return SimpleNamespace(proto=proto, options=CompileOptions(moe_lowering="if"), path="layers.0.moe")
    model, router, spec = build_routed_example()
    d = Path(tmp)
    onnx.save_model(router, d / "router.onnx")
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    return SimpleNamespace(proto=model, options=CompileOptions(groups=d / "spec.yaml"), path=spec["groups"][0]["name"])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("names"))


def _graphs(graph: onnx.GraphProto) -> Iterable[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for g in attr.graphs:
                yield from _graphs(g)


def _names(proto: onnx.ModelProto) -> set[str]:
    """Every name of the model: values, initializers, inputs, outputs, nodes, subgraphs, metadata keys."""
    names = {p.key for p in proto.metadata_props}
    for g in _graphs(proto.graph):
        names.add(g.name)
        names.update(v.name for v in (*g.input, *g.output, *g.value_info))
        names.update(t.name for t in g.initializer)
        for node in g.node:
            names.add(node.name)
            names.update(node.output)
    return {n for n in names if n}


def _compiled(proto: onnx.ModelProto, options: CompileOptions) -> onnx.ModelProto:
    result = compile_model(copy.deepcopy(proto), options)
    assert result.verification is not None and result.verification.passed
    return ir.to_proto(result.model)


@functools.cache
def _added(kind: str, tmp: str) -> tuple[str, ...]:
    """The names a compile of the clean model added, and the contract's names for its path."""
    case = _case(kind, tmp)
    added = _names(_compiled(case.proto, case.options)) - _names(case.proto)
    return tuple(sorted(added | set(_reserved(case.path))))


def _reserved(path: str) -> list[str]:
    return [
        contract.MASK_PREFIX + path,
        contract.ROUTER_PREFIX + path,
        contract.THRESHOLD_INPUT,
        contract.FORCE_OFF_PREFIX + path,
        contract.BLOCK_PREFIX + path,
        contract.DYNAMIC_META_KEY,
        contract.REFUSED_META_KEY,
        contract.SOLIDIFIED_META_KEY,
    ]


def _is_reserved(name: str, place: str) -> bool:
    """Whether planting ``name`` at ``place`` must be refused: a ``layerzero::`` interface name (graph input or
    output) or a metadata key the passes keep their records in."""
    if place in ("input", "output"):
        return name.startswith(contract.RUNTIME_PREFIX)
    if place == "metadata":
        return name in contract.RESERVED_META_KEYS
    return False


def _first_input(proto: onnx.ModelProto) -> onnx.ValueInfoProto:
    return proto.graph.input[0]


def _seed(proto: onnx.ModelProto, graph: onnx.GraphProto, name: str) -> str:
    """A float scalar computed from the model's first input (not a constant: nothing folds it away)."""
    x = _first_input(proto).name
    graph.node.extend(
        [
            helper.make_node("ReduceSum", [x], [f"{name}_sum"], keepdims=0, name=f"{name}_sum"),
            helper.make_node("Cast", [f"{name}_sum"], [name], to=TensorProto.FLOAT, name=name),
        ]
    )
    return name


def _plant(proto: onnx.ModelProto, names: Iterable[str], place: str) -> onnx.ModelProto:
    """``proto`` with ``names`` at ``place``, used so no pass removes them (``Sin`` chains: no static pass folds or
    skips one, where an ``Identity`` chain would be gone before the dynamic passes run); the extra results are graph
    outputs ``user_*``, so verification checks them too."""
    model = copy.deepcopy(proto)
    graph = model.graph
    names = list(names)
    if place == "metadata":
        for name in names:
            model.metadata_props.append(onnx.StringStringEntryProto(key=name, value="the user's"))
        return model
    if place == "input":
        for name in names:
            graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]))
        total = helper.make_node("Sum", names, ["user_inputs"], name="user_inputs")
        graph.node.append(total)
        graph.output.append(helper.make_tensor_value_info("user_inputs", TensorProto.FLOAT, [1]))
        return model
    seed = _seed(model, graph, "user_seed")
    if place == "output":
        for name in names:
            graph.node.append(helper.make_node("Sin", [seed], [name], name=f"user_sin_{len(graph.node)}"))
            graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))
        return model
    if place == "initializer":
        for k, name in enumerate(names):
            graph.initializer.append(numpy_helper.from_array(np.array(k + 1, np.float32), name))
        graph.node.append(helper.make_node("Sum", [seed, *names], ["user_initializers"], name="user_initializers"))
        graph.output.append(helper.make_tensor_value_info("user_initializers", TensorProto.FLOAT, []))
        return model
    if place in ("value", "node"):
        value = seed
        for k, name in enumerate(names):
            out = name if place == "value" else f"user_chain_{k}"
            node_name = name if place == "node" else f"user_chain_node_{k}"
            graph.node.append(helper.make_node("Sin", [value], [out], name=node_name))
            value = out
        graph.node.append(helper.make_node("Identity", [value], ["user_chain"], name="user_chain"))
        graph.output.append(helper.make_tensor_value_info("user_chain", TensorProto.FLOAT, []))
        return model
    assert place == "subgraph"
    branch = helper.make_graph([], "user_then", [], [])
    value = seed
    for name in names:
        branch.node.append(helper.make_node("Sin", [value], [name], name=f"user_then_{len(branch.node)}"))
        value = name
    branch.output.append(helper.make_tensor_value_info(value, TensorProto.FLOAT, []))
    other = helper.make_graph(
        [helper.make_node("Neg", [seed], ["user_else_out"], name="user_else")],
        "user_else",
        [],
        [helper.make_tensor_value_info("user_else_out", TensorProto.FLOAT, [])],
    )
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "user_zero")
    graph.initializer.append(zero)
    graph.node.extend(
        [
            helper.make_node("Greater", [seed, "user_zero"], ["user_cond"], name="user_cond"),
            helper.make_node("If", ["user_cond"], ["user_if"], name="user_if", then_branch=branch, else_branch=other),
        ]
    )
    graph.output.append(helper.make_tensor_value_info("user_if", TensorProto.FLOAT, []))
    return model


def _unique_per_graph(proto: onnx.ModelProto) -> list[str]:
    """Value names defined twice within one graph scope (an outer graph's names included)."""
    dupes: list[str] = []

    def walk(graph: onnx.GraphProto, outer: set[str]) -> None:
        seen = set(outer)
        defined = [*(v.name for v in graph.input), *(t.name for t in graph.initializer)]
        defined += [o for n in graph.node for o in n.output if o]
        inputs_with_init = {v.name for v in graph.input} & {t.name for t in graph.initializer}
        for name in defined:
            if name in seen and name not in inputs_with_init:
                dupes.append(name)
            seen.add(name)
        for node in graph.node:
            for attr in node.attribute:
                for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    walk(g, seen)

    walk(proto.graph, set())
    return dupes


def _user_outputs_kept(planted: onnx.ModelProto, compiled: onnx.ModelProto) -> bool:
    """Whether the user's planted results are still computed (their ``user_*`` outputs are there)."""
    wanted = {o.name for o in planted.graph.output if o.name.startswith("user_")}
    return wanted <= {o.name for o in compiled.graph.output}


def _check(kind: str, tmp: str, names: list[str], place: str) -> None:
    case = _case(kind, tmp)
    planted = _plant(case.proto, names, place)
    refused = [n for n in names if _is_reserved(n, place)]
    if refused:
        with pytest.raises(InvalidInputError) as info:
            compile_model(planted, case.options)
        message = str(info.value)
        assert "\n" not in message.strip(), message
        assert any(n in message for n in refused), message
        return
    try:
        compiled = _compiled(planted, case.options)  # verification passed: the outputs equal the original's
    except InvalidInputError as refusal:
        # A clear refusal is a correct answer too, when it is one line naming what the user planted: a node named
        # "/layers.1/..." claims that scope (a name is how an ONNX file says which module a node belongs to).
        message = str(refusal)
        assert "\n" not in message.strip(), message
        assert any(n in message for n in names) or "user_" in message, message
        return
    assert _user_outputs_kept(planted, compiled), place
    outputs = [o.name for o in compiled.graph.output]
    assert [o.name for o in planted.graph.output] == [o for o in outputs if not contract.is_runtime_output(o)]
    assert not _unique_per_graph(compiled), _unique_per_graph(compiled)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", KINDS)
def test_names_lz_adds_already_in_the_model(kind: str, place: str, tmp: str) -> None:
    # Every name the compile adds, planted at once (those that must be refused are checked one by one below).
    names = [n for n in _added(kind, tmp) if not _is_reserved(n, place)]
    _check(kind, tmp, names, place)


@pytest.mark.parametrize("place", ["input", "output", "metadata"])
@pytest.mark.parametrize("kind", KINDS)
def test_reserved_names_are_refused_naming_them(kind: str, place: str, tmp: str) -> None:
    for name in [n for n in _added(kind, tmp) if _is_reserved(n, place)]:
        _check(kind, tmp, [name], place)


def test_the_cli_refuses_a_reserved_input_with_exit_2(tmp_path: Path, helpers: SimpleNamespace) -> None:
    proto = _plant(build_gated_model("scalar"), [contract.THRESHOLD_INPUT], "input")
    onnx.save_model(proto, tmp_path / "m.onnx")
    result = helpers.run_cli("compile", tmp_path / "m.onnx", "-o", tmp_path / "m.lz")
    helpers.one_line(result, contract.THRESHOLD_INPUT)
    assert not (tmp_path / "m.lz").exists()


def test_the_force_off_variant_takes_its_names_from_values_that_had_them(tmp: str) -> None:
    # The profiler's variant adds the input layerzero::force_off::<path> and the output layerzero::block::<path>;
    # a value of the model already called so is renamed, the variant runs and matches the compiled model.
    import onnxruntime as ort

    from layerzero.passes.force_off import ExposeForceOff

    case = _case("gate", tmp)
    names = [contract.FORCE_OFF_PREFIX + case.path, contract.BLOCK_PREFIX + case.path]
    compiled = _compiled(_plant(case.proto, names, "value"), case.options)
    variant = ir.from_proto(compiled)
    assert ExposeForceOff()(variant).modified
    proto = ir.to_proto(variant)
    assert not _unique_per_graph(proto)
    assert names[0] in [i.name for i in proto.graph.input] and names[1] in [o.name for o in proto.graph.output]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 16)).astype(np.float32), "gate_0": np.array(0.7, np.float32)}

    def run(model: onnx.ModelProto, extra: dict) -> dict[str, np.ndarray]:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        wanted = {i.name for i in session.get_inputs()}
        out = session.run(None, {k: v for k, v in {**feeds, **extra}.items() if k in wanted})
        return dict(zip([o.name for o in session.get_outputs()], out))

    plain = run(compiled, {})
    forced = run(proto, {names[0]: np.array(False)})
    for name in ("y", "user_chain"):
        np.testing.assert_array_equal(forced[name], plain[name])
