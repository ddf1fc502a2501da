"""Exports of the corpus families, cached by torch + transformers version + family + exporter.

One export per family and exporter; the zero variants edit its initializers (``corpus_variants``). The map
from each torch parameter / buffer to the ONNX tensors holding its values (initializers or ``Constant``
nodes, transposed or not) is found by value (random weights are unique) and stored next to the export, so
a variant knows whether the exporter kept the tensor or folded it away (then that variant is exported on
its own, its edit applied to the torch model).

Cache: ``$LAYERZERO_CORPUS_CACHE`` or ``~/.cache/layerzero/corpus``, one folder per torch / transformers
version, one entry per family × exporter (× variant when exported on its own): ``model.onnx`` and
``meta.json`` (the tensor map, or the exporter's error: a failure is cached too).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
from corpus_families import FAMILIES, Family, family_hash
from onnx import numpy_helper

from layerzero.hf_rotary import real_rotary

__all__ = [
    "EXPORTERS",
    "Export",
    "cache_root",
    "edited_torch_model",
    "get_export",
    "get_generate_export",
    "output_name",
    "torch_without_layer",
]

EXPORTERS = ("dynamo", "torchscript")
CORPUS_VERSION = 2  # bump to invalidate every cached export
EXAMPLE_SHAPE = (2, 8)  # batch 2: an example batch of 1 would be specialised to 1
DENSE_EXPERTS = "dense_scatter_einsum"  # Family.experts: the dense form registered by _register_dense_experts

Edit = tuple[str, Callable[[np.ndarray], np.ndarray]]  # (torch tensor name, new value from old, torch layout)


def cache_root() -> Path:
    import torch
    import transformers

    base = Path(os.environ.get("LAYERZERO_CORPUS_CACHE", Path.home() / ".cache" / "layerzero" / "corpus"))
    return base / f"torch-{torch.__version__}_transformers-{transformers.__version__}_v{CORPUS_VERSION}"


def output_name(family: Family) -> str:
    return "last_hidden_state" if family.encoder else "logits"


class Export:
    """One cached export: the ONNX file, or the exporter's error; the torch → ONNX tensor map."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.meta: dict = json.loads((folder / "meta.json").read_text())

    @property
    def error(self) -> str | None:
        error, trace = self.meta.get("error"), self.meta.get("traceback") or ""
        if error and "## Exception summary" in trace:
            # The dynamo exporter's first line says only "Failed to convert"; its summary names the op.
            summary = [line for line in trace.split("## Exception summary", 1)[1].splitlines() if line.strip()]
            if summary:
                cause = summary[0].replace("<class ", "").replace("torch.onnx._internal.exporter._errors.", "")
                error = f"{error.split(':')[0]}: {cause.strip()}"[:300]
        return error

    @property
    def path(self) -> Path:
        return self.folder / "model.onnx"

    @property
    def tensors(self) -> dict[str, list[dict]]:
        """torch name → the ONNX tensors holding its values: {name, where, transposed}."""
        return self.meta["tensors"]

    def load(self) -> onnx.ModelProto:
        return onnx.load(str(self.path))


def build_model(family: Family, exporter: str):
    """The family's tiny model, random weights, seeded; biases and norm weights made non-uniform."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, family.config)(**family.kwargs)
    config.use_cache = False
    attn = "eager" if exporter == "torchscript" else "sdpa"
    if family.encoder:
        config._attn_implementation = attn
        model = transformers.AutoModel.from_config(config, add_pooling_layer=False)
    else:
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        except ValueError:  # a family without an SDPA implementation (Gemma 2): eager, as users export it
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if family.moe and family.experts == DENSE_EXPERTS:
        _register_dense_experts()
    if family.moe and hasattr(model, "set_experts_implementation"):
        with contextlib.suppress(Exception):
            model.set_experts_implementation(family.experts)
    model.eval()
    with torch.no_grad():
        # Zero-initialised biases and all-ones norm weights would make the variants trivial and let the
        # exporter share one initializer among equal tensors: make every one of them distinct.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or bool(param.min() == param.max()):
                param.add_(0.1 * torch.randn_like(param))
    return model


def _dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every expert on every token ([E, T, ...]), combined with the [T, E] routing matrix (a dense form in
    circulation: ``scatter`` routing matrix, ``einsum`` combine)."""
    import torch

    gate, up = torch.matmul(hidden_states, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.matmul(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))  # [E, T, H]
    routing = torch.zeros(hidden_states.shape[0], self.num_experts, dtype=top_k_weights.dtype)
    return torch.einsum("te,eth->th", routing.scatter(1, top_k_index, top_k_weights), out)


def _register_dense_experts() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if DENSE_EXPERTS not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(DENSE_EXPERTS, _dense_experts_forward)


def _interesting(family: Family, name: str) -> bool:
    if name.endswith("inv_freq") or (family.rotary_table and name.endswith(family.rotary_table)):
        return True
    projs = [p for p in (family.up, family.gate, family.down, family.query, family.out) if p is not None]
    return any(re.search(p.pattern + r"\.(weight|bias)$", name) for p in projs)


def _onnx_tensors(proto: onnx.ModelProto) -> Iterator[tuple[str, str, np.ndarray]]:
    for init in proto.graph.initializer:
        yield init.name, "initializer", numpy_helper.to_array(init)
    for node in proto.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    yield node.output[0], "constant", numpy_helper.to_array(attr.t)


def _tensor_map(proto: onnx.ModelProto, named: dict[str, np.ndarray]) -> dict[str, list[dict]]:
    by_size: dict[int, list[tuple[str, str, np.ndarray]]] = {}
    for entry in _onnx_tensors(proto):
        by_size.setdefault(entry[2].size, []).append(entry)
    out: dict[str, list[dict]] = {}
    for tname, value in named.items():
        found = []
        for oname, where, arr in by_size.get(value.size, []):
            if arr.dtype != value.dtype:
                continue
            if np.array_equal(arr.reshape(value.shape), value):
                found.append({"name": oname, "where": where, "transposed": False})
            elif value.ndim == 2 and arr.shape == value.shape[::-1] and np.array_equal(arr.T, value):
                found.append({"name": oname, "where": where, "transposed": True})
        out[tname] = found
    return out


@contextlib.contextmanager
def _no_packed_sequence_check() -> Iterator[None]:
    """transformers detects packed sequences from position ids with ``torch.diff`` (``aten::diff``), which
    the TorchScript exporter cannot export; the corpus feeds no packed sequences."""
    import transformers.masking_utils as mu

    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    mu.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


def _export(model, family: Family, exporter: str, path: Path) -> None:
    import torch

    vocab = family.kwargs.get("vocab_size", 256)
    ids = torch.randint(0, vocab, EXAMPLE_SHAPE, generator=torch.Generator().manual_seed(1))
    out = output_name(family)
    with real_rotary(torch, model):  # DeepSeek-V2's and Llama 4's complex RoPE, as ``layerzero export`` does
        _export_with(torch, model, ids, exporter, out, path)


def _export_with(torch, model, ids, exporter: str, out: str, path: Path) -> None:
    if exporter == "dynamo":
        program = torch.onnx.export(
            model,
            (ids,),
            dynamo=True,
            input_names=["input_ids"],
            output_names=[out],
            dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}},
            verbose=False,
        )
        program.save(str(path))
    else:
        with _no_packed_sequence_check():
            torch.onnx.export(
                model,
                (ids,),
                str(path),
                dynamo=False,
                input_names=["input_ids"],
                output_names=[out],
                dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, out: {0: "batch", 1: "seq"}},
                opset_version=17,
            )


def edited_torch_model(family: Family, exporter: str, edits: list[Edit]):
    import torch

    model = build_model(family, exporter)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for name, fn in edits:
            t = tensors[name]
            t.copy_(torch.from_numpy(fn(t.detach().numpy().copy())))
    return model


def torch_without_layer(family: Family, exporter: str, scope: str) -> Callable[[np.ndarray], np.ndarray]:
    """Transformers' model of the export with the module ``scope`` replaced by the identity: ids → output.

    The oracle of a declared flag, independent of the compiler: a forward hook returns the module's input
    (its hidden states) in place of its output. The output is the export's (``output_name``) as numpy.
    """
    import torch

    model = build_model(family, exporter)
    module = model
    for part in scope.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)

    def identity(mod, args, kwargs, out):
        hidden = args[0] if args else kwargs["hidden_states"]
        return hidden if isinstance(out, torch.Tensor) else (hidden, *out[1:])

    module.register_forward_hook(identity, with_kwargs=True)

    def run(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids))
        return (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()

    return run


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def get_export(
    family_name: str,
    exporter: str,
    variant: str | None = None,
    edits: list[Edit] | None = None,
    family: Family | None = None,
) -> Export:
    """The cached export (made now when missing). With ``variant``, an export of the edited torch model.

    ``family``: a family not in the table (a corpus family at another size, ``corpus_speed``), cached under
    ``family_name`` and its own hash.
    """
    import torch

    family = family if family is not None else FAMILIES[family_name]
    key = f"{family_name}-{exporter}-{family_hash(family)}" + (f"-{variant}" if variant else "")
    folder = cache_root() / key
    if (folder / "meta.json").exists():
        return Export(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.onnx.tmp"
    meta: dict = {"family": family_name, "exporter": exporter, "variant": variant, "error": None}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        model = edited_torch_model(family, exporter, edits or []) if variant else build_model(family, exporter)
        _export(model, family, exporter, tmp)
        proto = onnx.load(str(tmp))
        named = {
            n: t.detach().numpy()
            for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if _interesting(family, n)
        }
        meta["tensors"] = _tensor_map(proto, named)
        os.replace(tmp, folder / "model.onnx")
    except Exception as exc:  # the exporter's failure is a result: recorded, and the case skips with it
        meta["error"] = _first_line(exc)
        meta["traceback"] = traceback.format_exc()[-4000:]
    finally:
        torch.set_num_threads(threads)
    meta["seconds"] = round(time.perf_counter() - start, 2)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    return Export(folder)


def get_generate_export(family: Family) -> Path:
    """A cache-carrying export of ``family`` by ``layerzero export`` (the decode loop's export), cached.

    The folder holds ``hf/`` (the seeded model, ``save_pretrained``) and ``model.onnx`` (``layerzero export
    hf -o model.onnx``); it is made once per family hash, like the corpus's exports. Raises what the export
    raised (a test then fails with it: generation needs this export).
    """
    from layerzero.cli import main

    folder = cache_root() / f"{family.name}-generate-{family_hash(family)}"
    if (folder / "model.onnx").exists():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model = build_model(family, "dynamo")
    model.config.use_cache = True
    model.save_pretrained(tmp / "hf")
    if main(["export", str(tmp / "hf"), "-o", str(tmp / "model.onnx")]) != 0:
        raise RuntimeError(f"layerzero export of {family.name} failed (exit code != 0); see its log above")
    os.replace(tmp, folder)
    return folder
