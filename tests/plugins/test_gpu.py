"""The GPU check (scripts/gpu_check.sh / gpu_check.py): its logic on a CPU, its checks on a GPU.

On a CPU: argument parsing, the exit codes (a skip is exit 3, never a pass), the JSON report, the sanitizer's
summary parsing and verdicts (with a stand-in compute-sanitizer), and that the sanitizer driver compiles and
links with nvcc. On a GPU (CuPy and a device): the kernels against the numpy reference, and the TensorRT plan
where TensorRT exists (a skip otherwise, reported as a skip).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SHELL = ROOT / "scripts" / "gpu_check.sh"
DRIVER = Path(__file__).parent / "harness" / "kernel_driver.cpp"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("layerzero_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


# ------------------------------------------------------------------------------------------------ CPU


def test_arguments(gpu_check, tmp_path):
    args = gpu_check.parse_args([])
    assert args.build_dir is None and args.driver is None and args.json is None and not args.quick
    assert args.only is None and args.sanitizer_timeout == 150.0
    args = gpu_check.parse_args(
        ["--build-dir", str(tmp_path), "--driver", "d", "--json", "o.json", "--quick", "--only", "timing"]
    )
    assert args.build_dir == tmp_path and args.driver == Path("d") and args.json == Path("o.json") and args.quick
    assert args.only == ["timing"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "everything"])


def test_exit_codes_never_count_a_skip_as_a_pass(gpu_check):
    code = gpu_check.exit_code
    assert code({"a": "passed", "b": "passed"}) == gpu_check.EXIT_PASSED == 0
    assert code({"a": "passed", "b": "skipped"}) == gpu_check.EXIT_SKIPPED == 3
    assert code({"a": "failed", "b": "skipped"}) == gpu_check.EXIT_FAILED == 1
    assert code({"a": "passed", "environment": "incomplete"}) == gpu_check.EXIT_INCOMPLETE == 2
    assert code({"a": "failed", "environment": "incomplete"}) == 1


class _FakeLoader:
    class PluginError(RuntimeError):
        pass

    @staticmethod
    def load_kernels(build_dir=None):
        return type("Lib", (), {"path": Path("liblayerzero_kernels.so")})()


class _FakeDevice:
    name, capability = "fake", "9.0"


def _fake_machine(monkeypatch, gpu_check, **outcomes):
    """Kernels, a device and the checks replaced; unspecified checks pass, ``tensorrt`` runs for real."""
    monkeypatch.setattr(gpu_check, "plugin_modules", lambda: (_FakeLoader, None))
    monkeypatch.setattr(gpu_check, "Device", _FakeDevice)
    monkeypatch.setattr(gpu_check, "environment", lambda dev: {"gpu": "fake"})
    for name in ("correctness", "sanitizer", "timing", "tensorrt"):
        if name in outcomes:
            result = outcomes[name]

            def check(*args, _result=result, **kwargs):
                if isinstance(_result, Exception):
                    raise _result
                return _result

            monkeypatch.setattr(gpu_check, f"check_{name}", check)
        elif name != "tensorrt":
            monkeypatch.setattr(
                gpu_check, f"check_{name}", lambda *a, _n=name, **k: gpu_check.Outcome("passed", figures={_n: 1.5})
            )


def test_tensorrt_absent_is_a_skip_with_exit_3(gpu_check, monkeypatch, tmp_path, capsys):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here: its check would run, not skip")
    _fake_machine(monkeypatch, gpu_check)
    out = tmp_path / "report" / "gpu.json"
    assert gpu_check.main(["--json", str(out)]) == 3
    report = json.loads(out.read_text())
    assert report["status"] == "passed with skips" and report["exit_code"] == 3
    assert set(report["skipped"]) == {"tensorrt"} and "tensorrt" in report["skipped"]["tensorrt"]
    assert report["checks"]["correctness"]["status"] == "passed"
    assert report["checks"]["timing"]["figures"]["timing"] == 1.5  # every figure lands in the JSON
    assert "GPU CHECK PASSED WITH SKIPS" in capsys.readouterr().out


def test_a_failed_check_fails_the_run_and_the_others_still_run(gpu_check, monkeypatch, tmp_path, capsys):
    _fake_machine(
        monkeypatch,
        gpu_check,
        correctness=gpu_check.Outcome("failed", "2 of 39 cases failed"),
        sanitizer=RuntimeError("driver crashed"),
        tensorrt=gpu_check.Outcome("passed"),
    )
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["status"] == "failed"
    assert report["failed"] == {"correctness": "2 of 39 cases failed", "sanitizer": "RuntimeError: driver crashed"}
    assert report["checks"]["timing"]["status"] == "passed"
    assert "GPU CHECK FAILED" in capsys.readouterr().out


def test_everything_passed_is_exit_0(gpu_check, monkeypatch, tmp_path):
    _fake_machine(monkeypatch, gpu_check, tensorrt=gpu_check.Outcome("passed"))
    assert gpu_check.main(["--json", str(tmp_path / "gpu.json")]) == 0
    assert json.loads((tmp_path / "gpu.json").read_text())["status"] == "passed"


def test_only_runs_the_selected_checks_and_skips_the_rest(gpu_check, monkeypatch, tmp_path):
    _fake_machine(monkeypatch, gpu_check, tensorrt=gpu_check.Outcome("passed"))
    assert gpu_check.main(["--only", "timing", "--json", str(tmp_path / "gpu.json")]) == 3
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert set(report["skipped"]) == {"correctness", "sanitizer", "tensorrt"}


def test_missing_kernels_library_is_incomplete_with_a_json(gpu_check, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("LAYERZERO_PLUGIN_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--build-dir", str(tmp_path / "empty"), "--json", str(out)]) == 2
    report = json.loads(out.read_text())
    assert report["status"] == "incomplete" and "liblayerzero_kernels.so not found" in report["reason"]
    assert "GPU CHECK INCOMPLETE" in capsys.readouterr().out.splitlines()[-1]


def test_no_cupy_is_incomplete(gpu_check, monkeypatch, kernels_path, tmp_path):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(kernels_path.parent))
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--json", str(out)]) == 2
    assert "CuPy does not import" in json.loads(out.read_text())["reason"]


def test_sanitizer_summary_parsing(gpu_check):
    findings = gpu_check.sanitizer_findings
    assert findings("========= COMPUTE-SANITIZER\nDRIVER PASSED\n========= ERROR SUMMARY: 0 errors\n") == 0
    assert findings("========= ERROR SUMMARY: 3 errors\n") == 3
    assert findings("========= ERROR SUMMARY: 1 error\n") == 1
    assert findings("========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)\n") == 2
    assert findings("segmentation fault\n") is None


def _fake_sanitizer(bin_dir: Path, summary: str, rc: int) -> None:
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "compute-sanitizer"
    tool.write_text(f'#!/bin/sh\necho "DRIVER PASSED"\necho "========= {summary}"\nexit {rc}\n')
    tool.chmod(0o755)


@pytest.mark.parametrize(
    ("summary", "rc", "status"),
    [("ERROR SUMMARY: 0 errors", 0, "passed"), ("ERROR SUMMARY: 2 errors", 86, "failed"), ("", 0, "failed")],
)
def test_sanitizer_verdicts(gpu_check, monkeypatch, tmp_path, summary, rc, status):
    _fake_sanitizer(tmp_path / "bin", summary, rc)
    driver = tmp_path / "driver"
    driver.write_text("#!/bin/sh\nexit 0\n")
    driver.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    outcome = gpu_check.check_sanitizer(driver, timeout_s=60)
    assert outcome.status == status, outcome
    assert set(outcome.figures) == {"memcheck", "racecheck"}


def test_sanitizer_without_driver_is_a_skip_and_a_missing_driver_a_failure(gpu_check, tmp_path):
    assert gpu_check.check_sanitizer(None, timeout_s=1).status == "skipped"
    assert gpu_check.check_sanitizer(tmp_path / "nope", timeout_s=1).status == "failed"


def test_sanitizer_driver_compiles_and_links_with_nvcc(nvcc, kernels_path, tmp_path):
    exe = tmp_path / "kernel_driver"
    cmd = [nvcc, "-std=c++17", "-O2", "-Xcompiler", "-Wall,-Wextra", f"-I{ROOT / 'plugins' / 'include'}", str(DRIVER)]
    cmd += [f"-L{kernels_path.parent}", "-llayerzero_kernels", "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
    assert exe.is_file()


def test_shell_script_without_a_driver_is_incomplete(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi exists here: the script would go on to build")
    out = tmp_path / "gpu.json"
    env = dict(os.environ, GPU_CHECK_JSON=str(out))
    proc = subprocess.run(["bash", str(SHELL)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("GPU CHECK INCOMPLETE: nvidia-smi not found")
    assert json.loads(out.read_text())["status"] == "incomplete"


class _HostDevice:
    """``Device``'s interface over host numpy arrays: pointers are keys of a table."""

    def __init__(self):
        self.arrays: dict[int, np.ndarray] = {}
        self.stream = type("Stream", (), {"ptr": 0})()

    def _keep(self, array):
        self.arrays[id(array)] = array
        return array

    def put(self, array):
        return self._keep(np.ascontiguousarray(array).copy())

    def empty(self, shape, dtype):
        return self._keep(np.zeros(shape, dtype))

    def ptr(self, array):
        return id(array) if array.size else 0

    def get(self, array):
        return array.copy()


class _ReferenceKernels:
    """The C ABI's forward / route computed by the numpy reference, on ``_HostDevice`` pointers."""

    def __init__(self, gpu_check, reference, dev, error=0.0):
        self.g, self.reference, self.dev, self.error = gpu_check, reference, dev, error

    def workspace_size(self, config):
        return 256

    def _values(self, ptr, dtype, shape):
        if ptr == 0:
            return np.zeros(shape, np.float32)
        a = self.dev.arrays[ptr]
        return self.g.bf16_to_f32(a) if dtype == "bfloat16" else a.astype(np.float32)

    def _attrs(self, c):
        scoring = ("softmax", "sigmoid")[c.scoring]
        activation = ("silu", "gelu", "relu")[c.activation]
        return dict(
            top_k=c.top_k,
            normalize=c.normalize,
            scoring=scoring,
            activation=activation,
            zeroing_threshold=c.zeroing_threshold,
        )

    def forward(
        self, c, dtype, *, hidden, router_logits, w_gate, w_up, w_down, y, mask, workspace, workspace_size, stream=0
    ):
        T, H, F, E = c.tokens, c.hidden, c.ffn, c.experts
        args = [
            self._values(p, dtype, s)
            for p, s in (
                (hidden, (T, H)),
                (router_logits, (T, E)),
                (w_gate, (E, F, H)),
                (w_up, (E, F, H)),
                (w_down, (E, H, F)),
            )
        ]
        out, m = self.reference.moe_reference(*args, **self._attrs(c))
        out = out + self.error
        if y:
            target = self.dev.arrays[y]
            target[...] = self.g.bf16_bits(out) if dtype == "bfloat16" else out.astype(target.dtype)
        if mask:
            self.dev.arrays[mask][...] = m

    def route(self, c, dtype, router_logits, topk_index, topk_weight, mask, stream=0):
        _, m = self.reference.moe_routing_mask(self._values(router_logits, dtype, (c.tokens, c.experts)), c)
        if mask:
            self.dev.arrays[mask][...] = m


@pytest.mark.parametrize(("error", "status"), [(0.0, "passed"), (0.05, "failed")])
def test_correctness_check_plumbing_on_the_host(gpu_check, monkeypatch, error, status):
    # The check's own plumbing (uploads, dtypes, bf16 bits, masks, T = 0, the figures) against kernels that are
    # the reference itself: it passes them, and fails them once y is off by 0.05.
    loader, reference = gpu_check.plugin_modules()
    dev = _HostDevice()

    class Reference:
        moe_reference = staticmethod(reference.moe_reference)

        @staticmethod
        def moe_routing_mask(logits, c):
            attrs = dict(
                top_k=c.top_k,
                normalize=c.normalize,
                scoring=("softmax", "sigmoid")[c.scoring],
                zeroing_threshold=c.zeroing_threshold,
            )
            return reference.moe_routing(logits, **attrs)

    monkeypatch.setattr(gpu_check, "CASES", [c for c in gpu_check.CASES if c[0] in (0, 1, 9) or c[3] == 256][:5])
    lib = _ReferenceKernels(gpu_check, Reference, dev, error)
    outcome = gpu_check.check_correctness(lib, loader, reference, dev)
    assert outcome.status == status, outcome.reason
    cases = outcome.figures["cases"]
    assert len(cases) == 3 * len(gpu_check.CASES)
    assert {c["dtype"] for c in cases} == {"float32", "float16", "bfloat16"}
    assert any(c["tokens"] == 0 for c in cases) and any(c["experts"] == 256 for c in cases)
    if status == "passed":
        assert all(c["mask_agreement"] == 1.0 and c["route_mask_equal"] for c in cases)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.fixture
def device(gpu_check):
    try:
        return gpu_check.Device()
    except gpu_check.EnvironmentMissing as e:
        pytest.skip(f"needs a CUDA device and CuPy: {e}")


def test_kernels_match_the_numpy_reference(device, gpu_check, kernels_path):
    loader, reference = gpu_check.plugin_modules()
    outcome = gpu_check.check_correctness(loader.load_kernels(kernels_path), loader, reference, device)
    assert outcome.status == "passed", outcome.reason


def test_tensorrt_plan_matches_onnxruntime(device, gpu_check, kernels_build):
    outcome = gpu_check.check_tensorrt(kernels_build.build_dir)
    if outcome.status == "skipped":
        pytest.skip(outcome.reason)
    assert outcome.status == "passed", outcome
