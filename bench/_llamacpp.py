"""llama.cpp for bench/decode.py: GGUF files converted from the bench's Hugging Face folder, quantized, and run.

- ``llama_cpp`` is llama-cpp-python built from PyPI's source distribution for this machine
  (``scripts/build_llamacpp.sh``; not a dependency of LayerZero, and CI never builds it: ``missing()`` says why a
  column cannot run).
- The converter is the one that source distribution ships (``vendor/llama.cpp/convert_hf_to_gguf.py`` with its
  ``conversion`` package and ``gguf-py``), extracted once from the sdist beside the bench's cache. It is run as
  shipped (``--outtype f32``) on a folder that links the bench's own ``config.json`` and safetensors (the same
  random weights every other column runs), plus a small byte-level BPE ``tokenizer.json`` written here: the
  random-weight model has no tokenizer and the converter needs one for the GGUF's vocabulary (padded to the
  config's ``vocab_size`` with ``[PADn]`` entries, as it does for any model). The one thing changed in the
  converter is its answer to the pre-tokenizer check (a hash of a reference text's tokens, compared with the
  tokenizers of published models; ours is none of them): it is told "default". The bench feeds token ids,
  never text, so llama.cpp's pre-tokenizer is never used.
- Q4_0 / Q8_0 files are ``llama_cpp.llama_model_quantize`` of that F32 file with llama.cpp's default parameters
  (what its ``llama-quantize`` tool does: the routers and norms stay F32; the output matrix gets the type
  llama.cpp picks for that file type).
- the F32 column runs with a float32 KV cache (the conversion's check: the export's logits within 1e-3), the
  quantized ones with llama.cpp's default f16 cache (what its users run);
- ``LlamaCppRunner`` runs greedy decode the way the other columns do (the prompt in one batch, then one token per
  step, argmax of the step's logits, ties to the lowest id as ``numpy.argmax``), timed the same way.

    python bench/_llamacpp.py convert CONVERTER_DIR SOURCE_DIR OUT.gguf     # (the bench runs this itself)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SDIST_DIRS = (Path("/work/cache/sdist"),)
#: llama.cpp file types (``enum llama_ftype``) of the bench's columns.
FTYPES = {"F32": 0, "Q8_0": 7, "Q4_0": 2}


def missing() -> str | None:
    """Why llama.cpp's columns cannot run here (None: they can)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama_cpp not importable ({exc}): build it with scripts/build_llamacpp.sh"
    if sdist() is None:
        return (
            "no llama-cpp-python source distribution for its converter (LAYERZERO_LLAMACPP_SDIST, or "
            "scripts/build_llamacpp.sh keeps one in /work/cache/sdist)"
        )
    return None


def version() -> str:
    import llama_cpp

    return str(llama_cpp.__version__)


def sdist() -> Path | None:
    """The source distribution to take the converter from: LAYERZERO_LLAMACPP_SDIST, else the one of the
    installed version in /work/cache/sdist, else the newest there."""
    given = os.environ.get("LAYERZERO_LLAMACPP_SDIST")
    if given:
        return Path(given) if Path(given).is_file() else None
    found = sorted(p for d in SDIST_DIRS if d.is_dir() for p in d.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        return None
    try:
        want = f"llama_cpp_python-{version()}.tar.gz"
    except ImportError:
        want = ""
    return next((p for p in found if p.name == want), found[-1])


def converter_dir(cache: Path) -> Path:
    """``vendor/llama.cpp``'s converter, its ``conversion`` package and ``gguf-py``, extracted once into ``cache``."""
    archive = sdist()
    if archive is None:
        raise RuntimeError(missing() or "no llama-cpp-python source distribution")
    out = cache / archive.name.removesuffix(".tar.gz")
    done = out / ".extracted"
    if done.is_file():
        return out / "llama.cpp"
    with tarfile.open(archive) as tar:
        top = archive.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        members = []
        for m in tar.getmembers():
            if m.name.startswith(top) and m.name[len(top) :].startswith(wanted) and (m.isfile() or m.isdir()):
                m.name = "llama.cpp/" + m.name[len(top) :]
                members.append(m)
        tar.extractall(out, members=members, filter="data")
    done.write_text(archive.name)
    return out / "llama.cpp"


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer (the 256 byte symbols and a few merges learnt from a fixed text) for the
    converter's vocabulary; the GGUF pads it to the config's vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    text = ["the quick brown fox jumps over the lazy dog " * 4, "a decode step reads every weight once " * 4]
    tokenizer.train_from_iterator(text, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096})
    )


def convert(hf: Path, out: Path, cache: Path, say) -> None:
    """``out`` (F32 GGUF) from the Hugging Face folder ``hf`` with the sdist's converter (see the module doc)."""
    if out.is_file():
        return
    source = out.parent / "gguf-source"
    source.mkdir(parents=True, exist_ok=True)
    for f in hf.iterdir():
        if f.is_file() and (f.name == "config.json" or f.suffix == ".safetensors" or f.name.endswith(".index.json")):
            link = source / f.name
            if not link.exists():
                link.symlink_to(f.resolve())
    if not (source / "tokenizer.json").is_file():
        write_tokenizer(source)
    tool = converter_dir(cache)
    say(f"llama.cpp: converting {hf} to {out.name} with {tool / 'convert_hf_to_gguf.py'}")
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, str(Path(__file__).resolve()), "convert", str(tool), str(source), str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not tmp.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}): {' | '.join(tail)}")
    tmp.replace(out)


def quantize(f32: Path, out: Path, kind: str, say, threads: int = 2) -> None:
    """``out`` = ``llama_model_quantize`` of ``f32`` to ``kind`` (Q4_0, Q8_0) with llama.cpp's default params."""
    if out.is_file():
        return
    import llama_cpp

    say(f"llama.cpp: quantizing {f32.name} to {kind}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = threads
    tmp = out.with_name(out.name + ".tmp")
    code = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params)
    if code != 0 or not tmp.is_file():
        raise RuntimeError(f"llama_model_quantize {f32.name} -> {kind} failed ({code})")
    tmp.replace(out)


class LlamaCppRunner:
    """One GGUF file at one thread count: greedy decode timed like the bench's engines, and the prefill's logits."""

    def __init__(self, path: Path, threads: int, n_ctx: int, n_batch: int, kv_f32: bool = False) -> None:
        import llama_cpp

        self.path, self.threads = path, threads
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
            **_kv_types(kv_f32),
        )
        self._llama_cpp = llama_cpp

    def _last_logits(self) -> np.ndarray:
        llama_cpp = self._llama_cpp
        vocab = self.llm.n_vocab()
        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(vocab,))

    def generate(self, prompt: list[int], new: int) -> dict[str, Any]:
        """Greedy ids, time to first token, decode tokens/s (new tokens after the first / their time) and the
        median step time, as ``Engine.generate``'s report gives them."""
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        ids = [int(np.argmax(self._last_logits()))]
        first = time.perf_counter()
        steps: list[float] = []
        while len(ids) < new:
            t0 = time.perf_counter()
            llm.eval([ids[-1]])
            ids.append(int(np.argmax(self._last_logits())))
            steps.append(time.perf_counter() - t0)
        end = time.perf_counter()
        tps = (len(ids) - 1) / (end - first) if len(ids) > 1 else 0.0
        return {"ids": ids, "ttft": first - start, "tps": tps, "step": statistics.median(steps) if steps else 0.0}


def _kv_types(f32: bool) -> dict[str, int]:
    """A float32 KV cache (GGML_TYPE_F32 = 0) for the F32 column, llama.cpp's default (f16) otherwise: with f16 the
    bench's random Mixtral-style model's F32 logits were 2.2e-1 (relative L2) from the export's, with f32 6e-6
    (a random deep model amplifies the cache's rounding)."""
    return {"type_k": 0, "type_v": 0} if f32 else {}


def prefill_logits(path: Path, prompt: list[int], threads: int = 2, kv_f32: bool = False) -> np.ndarray:
    """The logits of every prompt position ([n, vocab]) of one prefill batch (a context with logits_all)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=max(64, len(prompt) + 8),
        n_batch=len(prompt),
        n_ubatch=len(prompt),
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
        **_kv_types(kv_f32),
    )
    llm.eval(prompt)
    out = np.array(llm.scores[: len(prompt)], dtype=np.float32)
    del llm
    return out


def _convert_main(tool: str, source: str, out: str) -> int:
    """Run the sdist's convert_hf_to_gguf.py (as shipped, but for the pre-tokenizer answer; see the module doc)."""
    sys.path[:0] = [tool, str(Path(tool) / "gguf-py")]  # its gguf-py, as the converter itself puts first
    import runpy

    import conversion.base as base  # the converter's own package (``tool`` first on sys.path)

    for cls in vars(base).values():
        if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
            cls.get_vocab_base_pre = lambda self, tokenizer: "default"
    sys.argv = ["convert_hf_to_gguf.py", source, "--outfile", out, "--outtype", "f32"]
    runpy.run_path(str(Path(tool) / "convert_hf_to_gguf.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "convert":
        raise SystemExit(_convert_main(*sys.argv[2:]))
    print(__doc__, file=sys.stderr)
    raise SystemExit(2)
