"""Group-mask specs: read and check the YAML / JSON file that names groups of layers and their router.

::

    router:
      output: router_scores        # a value (graph output) of the model, OR
      model: router.onnx           # a separate ONNX router fed the model's inputs (path relative to the spec)
      output_name: scores          # ... and which of its outputs (optional when it has one)
    threshold: 0.5                 # a group is off when its router value is <= threshold (default 0.5)
    groups:
      - name: vision
        scopes: [layers.1, layers.2]
        index: 0                   # which element of the router output's last axis (default: the group's position)
      - name: audio
        scopes: [layers.3]
        index: 1

What can be checked without the model is checked here; the rest (scopes, index range, router
outputs) by ``layerzero.passes.group_masks.ApplyGroupMasks``. Every problem is an
``InvalidInputError`` that names the file.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.options import CompileOptions
from layerzero.passes.group_masks import DEFAULT_THRESHOLD, ApplyGroupMasks, Group, GroupRouter, GroupSpec

__all__ = ["GroupMasksFromFile", "apply_group_reference", "load_group_spec", "parse_group_spec"]

logger = logging.getLogger(__name__)

_TOP_KEYS = {"router", "threshold", "groups"}
_ROUTER_KEYS = {"output", "model", "output_name"}
_GROUP_KEYS = {"name", "scopes", "index"}


def load_group_spec(path: str | Path) -> GroupSpec:
    """Read a spec file (``.json``: JSON; anything else: YAML, of which JSON is a subset)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"{path}: group spec not found" if not path.exists() else f"{path}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{path}: cannot read the group spec: {exc}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{path}: not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidInputError(f"{path}: the group spec is nested too deeply") from None
    else:
        try:
            import yaml
        except ImportError:  # pragma: no cover - pyyaml is a dependency
            raise InvalidInputError(f"{path}: reading YAML needs pyyaml (pip install pyyaml), or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InvalidInputError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
        except RecursionError:  # a document nested thousands deep: the YAML composer recurses per level
            raise InvalidInputError(f"{path}: the group spec is nested too deeply") from None
    return parse_group_spec(data, base_dir=path.parent, source=str(path))


def parse_group_spec(data: Any, *, base_dir: str | Path = ".", source: str = "group spec") -> GroupSpec:
    """A spec from its parsed form (a dict); a router model path is read relative to ``base_dir``."""

    def fail(message: str) -> InvalidInputError:
        return InvalidInputError(f"{source}: {message}")

    if not isinstance(data, Mapping):
        raise fail(f"expected a mapping with keys {sorted(_TOP_KEYS)}, got {type(data).__name__}")
    _no_unknown(data, _TOP_KEYS, "the spec", fail)
    threshold = data.get("threshold", DEFAULT_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise fail(f"threshold must be a number, got {threshold!r}")
    router = _parse_router(data.get("router"), Path(base_dir), fail)
    raw_groups = data.get("groups")
    if not isinstance(raw_groups, list) or not raw_groups:
        raise fail("groups must be a non-empty list of {name, scopes, index}")
    groups: list[Group] = []
    names: set[str] = set()  # a set, not a scan of `groups`: 100k groups must parse in linear time
    for position, raw in enumerate(raw_groups):
        if not isinstance(raw, Mapping):
            raise fail(f"groups[{position}] must be a mapping with keys {sorted(_GROUP_KEYS)}")
        _no_unknown(raw, _GROUP_KEYS, f"groups[{position}]", fail)
        name = raw.get("name")
        if not isinstance(name, str) or not name.strip():
            raise fail(f"groups[{position}] needs a name (a non-empty string)")
        if name in names:
            raise fail(f"group name {name!r} is used twice")
        names.add(name)
        scopes = raw.get("scopes")
        if isinstance(scopes, str):
            scopes = [scopes]
        if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) and s for s in scopes):
            raise fail(f"group {name!r}: scopes must be a non-empty list of scope names (e.g. [layers.1])")
        index = raw.get("index", position)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise fail(f"group {name!r}: index must be a non-negative integer, got {index!r}")
        groups.append(Group(name, tuple(scopes), index))
    return GroupSpec(tuple(groups), router, float(threshold), source)


def _parse_router(raw: Any, base_dir: Path, fail: Any) -> GroupRouter:
    if not isinstance(raw, Mapping):
        raise fail("router must be a mapping: {output: <value of the model>} or {model: <file>, output_name: <name>}")
    _no_unknown(raw, _ROUTER_KEYS, "router", fail)
    output, model_file, output_name = raw.get("output"), raw.get("model"), raw.get("output_name")
    if (output is None) == (model_file is None):
        raise fail("router needs exactly one of 'output' (a value of the model) and 'model' (an ONNX router file)")
    if output is not None:
        if not isinstance(output, str) or not output:
            raise fail(f"router.output must be a value name, got {output!r}")
        if output_name is not None:
            raise fail("router.output_name goes with router.model, not router.output")
        return GroupRouter(output)
    if not isinstance(model_file, str) or not model_file:
        raise fail(f"router.model must be a file name, got {model_file!r}")
    path = base_dir / model_file
    if not path.is_file():
        raise fail(f"router model {path} not found (router.model is read relative to the spec file)")
    from layerzero.loader import load_model

    try:
        router = load_model(path)
    except LayerZeroError as exc:
        raise fail(f"router model: {exc}") from None
    if output_name is None:
        if len(router.graph.outputs) != 1:
            names = ", ".join(repr(v.name) for v in router.graph.outputs)
            raise fail(f"router model {path} has outputs {names}: name one with router.output_name")
        output_name = router.graph.outputs[0].name
    if not isinstance(output_name, str) or not output_name:
        raise fail(f"router.output_name must be an output name, got {output_name!r}")
    return GroupRouter(output_name, router)


def _no_unknown(mapping: Mapping, allowed: set[str], where: str, fail: Any) -> None:
    unknown = sorted(str(k) for k in mapping if k not in allowed)
    if unknown:
        raise fail(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; expected {sorted(allowed)}")


def _align_router_opset(spec: GroupSpec, model: ir.Model) -> GroupSpec:
    """A router model at the model's default-domain opset (converted when they differ)."""
    router = spec.router.model
    if router is None:
        return spec
    want = model.opset_imports.get("", None)
    have = router.opset_imports.get("", None)
    if want is None or have is None or want == have:
        return spec
    try:
        proto = onnx.version_converter.convert_version(ir.to_proto(router), want)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidInputError(
            f"{spec.source}: the router model is opset {have} and cannot be converted to the model's opset {want}: "
            f"{first}; export the router at opset {want}"
        ) from None
    logger.info("converted the router model from opset %d to %d", have, want)
    return GroupSpec(spec.groups, GroupRouter(spec.router.output, ir.from_proto(proto)), spec.threshold, spec.source)


class GroupMasksFromFile(ir.passes.InPlacePass):
    """The dynamic pass of the pipeline: ``ApplyGroupMasks`` with the spec ``options.groups`` names.

    Does nothing without ``options.groups``. Built as ``GroupMasksFromFile(options)`` (``DYNAMIC_PASSES``).
    """

    def __init__(self, options: CompileOptions, *, select: bool = False) -> None:
        super().__init__()
        self.options = options
        self.select = select

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.options.groups is None:
            return ir.passes.PassResult(model, modified=False)
        spec = _align_router_opset(load_group_spec(self.options.groups), model)
        return ApplyGroupMasks(spec, select=self.select)(model)


def apply_group_reference(model: ir.Model, options: CompileOptions) -> bool:
    """The verification reference: every grouped layer computes, ``Where(router on, layer, input)`` picks."""
    return GroupMasksFromFile(options, select=True)(model).modified
