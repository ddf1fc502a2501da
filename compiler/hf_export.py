"""Export a local Hugging Face causal LM to ONNX the way the compiler and ``Engine.generate`` expect.

    export_hf("llama_dir", "model.onnx")                    # cache-carrying, torch.onnx dynamo exporter
    export_hf("llama_dir", "model.onnx", cache=False)       # one pass: logits only

The graph's inputs are ``input_ids`` [batch, seq], ``attention_mask`` [batch, past + seq] and
``position_ids`` [batch, seq], then (with the cache) ``past_key_values.N.key`` / ``.value``
[batch, kv_heads, past, head_dim] per layer; its outputs are ``logits`` [batch, seq, vocab] and
``present.N.key`` / ``.value`` [batch, kv_heads, past + seq, head_dim].

The settings that make these exports work (each learnt from a failure):

- the model is exported as itself, its class swapped for a subclass whose ``forward`` takes flat tensors,
  so that module paths (and so flag scopes) read ``model.layers.3`` as in the checkpoint, not
  ``wrapper.model.model.layers.3``;
- the cache travels as flat tensors and is rebuilt into a ``DynamicCache`` inside: the exporters cannot
  return a ``DynamicCache``;
- MoE models use ``set_experts_implementation("batched_mm")``: the default per-expert loop is data
  dependent and does not export;
- the TorchScript exporter traces, so attention is ``eager`` (SDPA's mask handling specialises there);
- the example batch is 2 and the example past 4 tokens: a dim of 1 would be specialised to 1;
- complex rotary embeddings (DeepSeek-V2, Llama 4) are computed as the same product in real arithmetic while the
  exporter runs (``hf_rotary.real_rotary``): neither exporter has complex tensors;
- the written graph must type-check (ONNX's strict inference), else it is deleted and refused: the TorchScript
  exporter writes Llama 4's chunked mask as a ``CumSum`` of bools, which ONNX Runtime will not load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.hf_rotary import real_rotary

__all__ = ["EXPORTERS", "TOKENIZER_FILES", "ExportResult", "export_hf"]

logger = logging.getLogger(__name__)

EXPORTERS = ("dynamo", "torchscript")

#: Files copied beside the exported model when the model folder has them (tokenizer and generation config).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)

#: Model metadata key holding what ``Engine.generate`` needs to know about the export (JSON).
GENERATE_META_KEY = "layerzero.generate"

_EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_PAST = 2, 3, 4


@dataclasses.dataclass
class ExportResult:
    """What ``export_hf`` wrote."""

    path: Path
    model_type: str
    layers: int
    cache: bool
    exporter: str
    input_names: list[str]
    output_names: list[str]
    copied: list[str]


#: An export larger than this keeps its weights in ``<name>.data`` beside the graph file (``_set_metadata``);
#: the compiler's chunked verification starts at the same size.
EXTERNAL_DATA_BYTES = 256 * 2**20


def export_hf(
    model_dir: str | Path,
    out: str | Path,
    *,
    cache: bool = True,
    exporter: str = "dynamo",
    opset: int | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
    gguf_file: str | Path | None = None,
) -> ExportResult:
    """Export the causal LM saved (``save_pretrained``) in ``model_dir`` to ``out`` (``progress(stage)`` is told each
    stage: loading, exporting, writing).

    Nothing the export did not write is written over (checked before any work): an existing ``out`` is replaced
    only with ``force`` and only when it is a model ``export_hf`` wrote (its metadata says so), and ``<out>.data``
    only when it is that model's external data; the tokenizer files and ``generation_config.json`` copied beside
    ``out`` never replace a different file there (an identical one is left as it is), ``force`` or not.

    Raises:
        InvalidInputError: ``model_dir`` is not a Hugging Face model folder, a bad option, or an output that would
            replace a file the export did not write.
        UnsupportedModelError: transformers cannot load it as a causal LM, or the exporter failed
            (the message carries the exporter's reason, on one line).
    """
    model_dir, out = Path(model_dir), Path(out)
    if exporter not in EXPORTERS:
        raise InvalidInputError(f"exporter {exporter!r}: choose one of {', '.join(EXPORTERS)}")
    gguf = None if gguf_file is None else _gguf_path(model_dir, Path(gguf_file))
    if gguf is None and not (model_dir / "config.json").is_file():
        raise InvalidInputError(f"{model_dir}: no config.json (a folder written by save_pretrained expected; "
                                "a GGUF file: --gguf FILE)")  # fmt: skip
    stale_data, to_copy = _check_outputs(model_dir, out, force)
    try:
        import torch
        import transformers
    except ImportError as e:
        raise InvalidInputError(f"layerzero export needs torch and transformers (.[export] extra): {e}") from None

    say = progress or (lambda _stage: None)
    load: dict[str, Any] = {"local_files_only": True}
    tokenizer_dir = None
    if gguf is not None:
        # transformers reads the GGUF's config and dequantizes its tensors to float; its tokenizer (and chat
        # template) are written beside the export as a Hugging Face folder's would be.
        load["gguf_file"] = gguf.name
        model_dir = gguf.parent
        say("reading the GGUF file's tokenizer")
        tokenizer_dir = _gguf_tokenizer(transformers, gguf)
        if tokenizer_dir is not None:
            stale_data, to_copy = _check_outputs(tokenizer_dir, out, force)
    say("loading the model with transformers" + (" (dequantizing the GGUF file)" if gguf is not None else ""))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **load)
    except Exception as e:  # transformers raises many kinds; the user needs its reason, on one line
        raise UnsupportedModelError(f"{model_dir}: not loadable as a causal LM: {_one_line(e)}") from None
    model.eval()
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("batched_mm")
        except (ValueError, AttributeError, NotImplementedError) as e:
            logger.info("%s: no batched_mm experts implementation (%s)", model_dir, _one_line(e))
    if exporter == "torchscript":
        _set_attention(model, "eager")

    layers = int(text.num_hidden_layers)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    vocab = int(text.vocab_size)

    input_names = ["input_ids", "attention_mask", "position_ids"]
    output_names = ["logits"]
    if cache:
        input_names += [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        output_names += [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]

    shapes = _cache_shapes(model, layers, kv_heads, head_dim) if cache else []
    _make_flat(model, layers, cache, transformers)
    past = _EXAMPLE_PAST if cache else 0
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (_EXAMPLE_BATCH, _EXAMPLE_SEQ), generator=gen)
    mask = torch.ones(_EXAMPLE_BATCH, past + _EXAMPLE_SEQ, dtype=torch.int64)
    positions = torch.arange(past, past + _EXAMPLE_SEQ).expand(_EXAMPLE_BATCH, -1).contiguous()
    dtype = next(model.parameters()).dtype
    pasts = [torch.randn(_EXAMPLE_BATCH, heads, past, dim, generator=gen).to(dtype) for heads, dim in shapes]
    args = (ids, mask, positions, *pasts)

    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"exporting with torch.onnx ({exporter}{', KV cache' if cache else ''})")
    try:
        with torch.no_grad(), real_rotary(torch, model):
            if exporter == "dynamo":
                _export_dynamo(torch, model, args, out, input_names, output_names, cache, opset)
            else:
                _export_torchscript(torch, model, args, out, input_names, output_names, cache, opset)
    except Exception as e:
        raise UnsupportedModelError(
            f"{model_dir}: torch.onnx {exporter} export of {type(model).__name__} failed: {_one_line(e)}"
        ) from e

    meta = {
        "model_type": getattr(config, "model_type", ""),
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "cache": cache,
        "exporter": exporter,
        "eos_token_id": _eos(model),
    }
    say("writing the metadata and the tokenizer files")
    try:
        _check_types(out)
    except UnsupportedModelError as e:
        for written in (out, out.with_name(f"{out.name}.data")):
            written.unlink(missing_ok=True)  # no partial output: the graph is the exporter's, it cannot run
        hint = " (the dynamo exporter: --exporter dynamo)" if exporter != "dynamo" else ""
        what = f"{model_dir}: torch.onnx {exporter} export of {type(model).__name__}"
        raise UnsupportedModelError(f"{what} {e}{hint}") from None
    _set_metadata(out, meta)
    if stale_data is not None and stale_data.name not in _external_locations(out):
        stale_data.unlink(missing_ok=True)  # the replaced export's weights; the new one keeps its own inside
    copied = []
    source_dir = tokenizer_dir if tokenizer_dir is not None else model_dir
    for name in to_copy:
        target = out.parent / name
        if not os.path.lexists(target):  # checked up front; a file that appeared since is not ours either
            _copy_new(source_dir / name, target)
            copied.append(name)
    if tokenizer_dir is not None:
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
    return ExportResult(out, meta["model_type"], layers, cache, exporter, input_names, output_names, copied)


def _gguf_path(model_dir: Path, gguf: Path) -> Path:
    """The GGUF file: ``gguf`` as given, else inside ``model_dir``; one line when it is not a GGUF file."""
    path = gguf if gguf.is_absolute() or gguf.exists() else model_dir / gguf
    if not path.is_file():
        raise InvalidInputError(f"--gguf {gguf}: no such file (looked in {path.parent})")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise InvalidInputError(f"--gguf {gguf}: not a GGUF file (no GGUF magic)")
    return path


def _gguf_tokenizer(transformers: Any, gguf: Path) -> Path | None:
    """The GGUF's tokenizer saved as tokenizer files in a temporary folder (None when transformers cannot build
    one from it: the export goes on without text)."""
    import tempfile

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # a GGUF without tokenizer metadata, or one transformers cannot convert
        logger.warning("%s: no tokenizer from the GGUF file (%s); the export has none", gguf, _one_line(e))
        return None
    import atexit

    folder = Path(tempfile.mkdtemp(prefix="layerzero-gguf-tokenizer-"))
    atexit.register(shutil.rmtree, folder, True)  # also when the export fails on the way
    tokenizer.save_pretrained(str(folder))
    return folder


def _check_outputs(model_dir: Path, out: Path, force: bool) -> tuple[Path | None, list[str]]:
    """Refuse, before any work, an export that would write over a file it did not write (see ``export_hf``).

    Returns the existing ``<out>.data`` that belongs to the export being replaced (or None), and the names of
    the files to copy beside ``out`` (those not there yet, or there with the same bytes).
    """
    data = out.with_name(f"{out.name}.data")
    stale_data = None
    if os.path.lexists(out):
        if out.is_dir():
            raise InvalidInputError(f"-o {out}: is a directory; give a file name")
        if not force:
            raise InvalidInputError(
                f"-o {out}: exists; pass --force to replace it (only a model layerzero export wrote)"
            )
        if not _is_export(out):
            raise InvalidInputError(
                f"-o {out}: exists and is not a model layerzero export wrote; --force replaces only such a model: "
                "choose another output path"
            )
        if data.name in _external_locations(out):
            stale_data = data
    if os.path.lexists(data) and stale_data is None:
        raise InvalidInputError(
            f"{data}: exists and is not the weights of a model layerzero export wrote at -o {out}; it would be "
            "replaced by the export's external data: choose another output name"
        )
    to_copy = []
    for name in TOKENIZER_FILES:
        source, target = model_dir / name, out.parent / name
        if not source.is_file() or source.resolve() == target.resolve():
            continue
        if os.path.lexists(target):
            if not (target.is_file() and _same_bytes(source, target)):
                raise InvalidInputError(
                    f"{target}: exists and differs from {source}; layerzero export copies {name} beside the model "
                    "and never replaces a file there: export into another directory"
                )
            continue  # the same file: left as it is
        to_copy.append(name)
    return stale_data, to_copy


def _is_export(path: Path) -> bool:
    """Whether ``path`` is a model ``export_hf`` wrote (the metadata entry it records); weights are not read."""
    import onnx

    try:
        if not path.is_file() or path.stat().st_size > 2**31:
            return False  # an inline ONNX file is under protobuf's 2 GB; a larger file is no export of ours
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not ONNX at all: not ours
        return False
    return any(p.key == GENERATE_META_KEY for p in model.metadata_props)


def _external_locations(path: Path) -> set[str]:
    """The external-data files ``path``'s initializers name."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {
        e.value
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for e in t.external_data
        if e.key == "location"
    }


def _same_bytes(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            chunk = fa.read(1 << 20)
            if chunk != fb.read(1 << 20):
                return False
            if not chunk:
                return True


def _copy_new(source: Path, target: Path) -> None:
    """Copy ``source`` to a ``target`` that does not exist: written beside it, then linked in place (``os.link``
    fails if a file appeared there meanwhile: nothing is replaced)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(source, tmp)
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise InvalidInputError(f"{target}: appeared during the export; not replaced") from None
    except OSError:  # a filesystem without hard links: the existence was checked just before
        shutil.copyfile(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _one_line(e: BaseException) -> str:
    # The exporters' messages run to pages (advice, links, stack summaries): keep the first informative line.
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "Exception summary" not in ln and not ln.startswith(("-", "#")):
            first = ln
            break
    else:
        first = type(e).__name__
    # torch.onnx puts the real cause in an "<class ...>: reason" line after a summary header.
    for ln in lines:
        if ln.startswith("<class "):
            first = ln
            break
    return first[:400]


def _set_attention(model: Any, implementation: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(implementation)
            return
        except (ValueError, AttributeError, NotImplementedError):
            pass
    model.config._attn_implementation = implementation


def _cache_shapes(model: Any, layers: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(heads, dim) of each cache tensor (layer 0 key, value, layer 1 ...), from the cache a one-token forward of
    the model (before ``_make_flat``) fills: most families keep [batch, kv_heads, past, head_dim] keys and values,
    not every one (MLA's compressed cache, DeepSeek-V3: keys [batch, 1, past, kv_lora_rank], values [..,
    qk_rope_head_dim]). The config's kv_heads / head_dim where that forward fails or keeps no cache."""
    import torch

    fallback = [(kv_heads, head_dim)] * (2 * layers)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.zeros(1, 1, dtype=torch.int64), use_cache=True)
        kept = out.past_key_values.layers[:layers]
        shapes = [(int(t.shape[1]), int(t.shape[3])) for layer in kept for t in (layer.keys, layer.values)]
    except Exception as e:  # the export itself then says what fails
        logger.info("cache shapes from a forward failed (%s): the config's", _one_line(e))
        return fallback
    return shapes if len(shapes) == 2 * layers else fallback


def _make_flat(model: Any, layers: int, cache: bool, transformers: Any) -> None:
    """Swap the model's class for a subclass whose ``forward`` takes and returns flat tensors."""
    base = type(model)

    def forward(self: Any, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any) -> Any:
        kwargs: dict[str, Any] = {}
        if cache:
            dynamic = transformers.DynamicCache(config=self.config)
            for i in range(layers):
                dynamic.update(past[2 * i], past[2 * i + 1], i)
            kwargs["past_key_values"] = dynamic
        out = base.forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=cache,
            **kwargs,
        )
        if not cache:
            return out.logits
        flat = []
        for layer in out.past_key_values.layers[:layers]:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)

    model.__class__ = type(base.__name__, (base,), {"forward": forward})


def _export_dynamo(
    torch: Any,
    model: Any,
    args: tuple,
    out: Path,
    inputs: list[str],
    outputs: list[str],
    cache: bool,
    opset: int | None,
) -> None:
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    total, past = torch.export.Dim("total"), torch.export.Dim("past")
    if cache:
        shapes: tuple = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq})
        shapes += (tuple({0: batch, 2: past} for _ in args[3:]),)
    else:
        # No past: the mask is as long as the ids (one dim, or the export finds total == seq and refuses), and
        # the empty ``*past`` takes no entry (torch.export counts it as no input: 3 inputs, 3 shapes).
        shapes = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: seq})
    program = torch.onnx.export(
        model,
        args,
        dynamo=True,
        input_names=inputs,
        output_names=outputs,
        dynamic_shapes=shapes,
        opset_version=opset,
        verbose=False,
    )
    if program is None:
        raise RuntimeError("torch.onnx.export returned no program")
    # Weights past EXTERNAL_DATA_BYTES go straight to ``<out>.data``, one tensor at a time: saving them inline
    # (the exporter's choice under 2 GB) serializes the whole proto in memory, then ``_set_metadata`` reads and
    # moves them again (a 1.2 GB bf16 OLMoE layer: 7.8 GB peak inline, see bench/real_size.py).
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    program.save(str(out), external_data=size > EXTERNAL_DATA_BYTES)


def _export_torchscript(
    torch: Any,
    model: Any,
    args: tuple,
    out: Path,
    inputs: list[str],
    outputs: list[str],
    cache: bool,
    opset: int | None,
) -> None:
    axes = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total" if cache else "seq"},  # no past: as long as the ids
        "position_ids": {0: "batch", 1: "seq"},
        "logits": {0: "batch", 1: "seq"},
    }
    for name in inputs[3:]:
        axes[name] = {0: "batch", 2: "past"}
    for name in outputs[1:]:
        axes[name] = {0: "batch", 2: "total"}
    torch.onnx.export(
        model,
        args,
        str(out),
        dynamo=False,
        input_names=inputs,
        output_names=outputs,
        dynamic_axes=axes,
        opset_version=opset or 17,
    )


def _eos(model: Any) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def _check_types(path: Path) -> None:
    """Raise UnsupportedModelError when the exported graph does not type-check (ONNX's strict type and shape
    inference): the TorchScript exporter writes Llama 4's chunked-attention mask as a ``CumSum`` of a bool tensor,
    which torch promotes to int64 and ONNX has no kernel for; ONNX Runtime then refuses to load the model.

    The weights play no part: each initializer of more than a few values is checked as a graph input of its type
    and shape, so a 2 GB graph is checked without its bytes."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    heavy = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL or len(t.raw_data) > 256]
    for t in heavy:
        graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    names = {t.name for t in heavy}
    kept = [t for t in graph.initializer if t.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
        raise UnsupportedModelError(f"wrote a graph that does not type-check: {_one_line(e)}") from None


def _set_metadata(path: Path, meta: dict[str, Any]) -> None:
    """Record what generation needs in the model's metadata.

    Weights the exporter wrote to external data stay there. An export that kept them inside the graph file
    and is larger than ``EXTERNAL_DATA_BYTES`` (both exporters do so up to protobuf's 2 GB) gets them moved to
    ``<name>.data`` beside it: loading an inline file parses and copies every weight each time (verifying a
    389 M-parameter export read its 1.5 GB file three times: 288 s, 10.9 GB peak), external data is mapped
    (144 s, 2.5 GB peak).
    """
    import onnx

    inline_bytes = path.stat().st_size
    model = onnx.load(str(path), load_external_data=False)
    entries = {p.key: p.value for p in model.metadata_props}
    entries[GENERATE_META_KEY] = json.dumps(meta)
    del model.metadata_props[:]
    for key, value in entries.items():
        model.metadata_props.add(key=key, value=value)
    tmp = path.with_name(f".{path.name}.tmp")
    external = (
        not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
        and inline_bytes > EXTERNAL_DATA_BYTES
    )
    if external:
        data = path.with_name(f"{path.name}.data")
        data.unlink(missing_ok=True)  # onnx appends to an existing file; this one belongs to no model now
        onnx.save(
            model,
            str(tmp),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data.name,
            size_threshold=1024,
        )
    else:
        onnx.save(model, str(tmp))
    tmp.replace(path)
