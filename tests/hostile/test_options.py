"""Every numeric option is checked at parse time: finite, in range; exit 2, one line naming the option."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

BAD = [
    ("compile", "--atol", "nan"),
    ("compile", "--atol", "-1"),
    ("compile", "--atol", "inf"),
    ("compile", "--rtol", "-0.5"),
    ("compile", "--threshold", "-1"),
    ("compile", "--threshold", "nan"),
    ("compile", "--threshold", "2"),
    ("compile", "--max-deviation", "-inf"),
    ("compile", "--seed", "-3"),
    ("compile", "--seed", "1" * 300),
    ("compile", "--stability-window", "0"),
    ("compile", "--impact-tolerance", "nan"),
    ("compile", "--workspace-mb", "0"),
    ("serve", "--port-http", "70000"),
    ("serve", "--port-grpc", "0"),
    ("serve", "--port-metrics", "-1"),
    ("serve", "--instances", "0"),
    ("serve", "--sample-rate", "1.5"),
    ("serve", "--fallback-bound", "0"),
    ("serve", "--window-seconds", "nan"),
    ("serve", "--max-tokens", "0"),
    ("serve", "--max-request-bytes", "10"),
    ("serve", "--client-timeout", "-1"),
    ("serve", "--threshold", "1e999"),
    ("triton-export", "--sample-rate", "-0.1"),
    ("triton-export", "--instances", "100000"),
    ("report", "--impact-tolerance", "-1"),
    ("report", "--stability-window", "-5"),
    ("profile", "--impact-samples", "-1"),
    ("profile", "--top", "x"),
    ("demo", "--layers", "0"),
    ("demo", "--hidden", "99999999"),
]


def _args(verb: str, option: str, value: str, tiny: SimpleNamespace) -> list:
    positional = {
        "compile": [tiny.source, "-o", tiny.dir / "never.lz"],
        "serve": [tiny.bundle],
        "triton-export": [tiny.bundle, tiny.dir / "never-repo"],
        "report": [tiny.dir / "p.json", "-o", tiny.dir / "never.png"],
        "profile": [tiny.bundle, "--data", tiny.dir / "none.npz"],
        "demo": [],
    }[verb]
    return [verb, *positional, f"{option}={value}"]


@pytest.mark.parametrize(("verb", "option", "value"), BAD, ids=[f"{v}{o}={x[:8]}" for v, o, x in BAD])
def test_bad_number_exits_2_naming_the_option(verb: str, option: str, value: str, tiny: SimpleNamespace,
                                              helpers: SimpleNamespace) -> None:  # fmt: skip
    result = helpers.run_cli(*_args(verb, option, value, tiny))
    helpers.one_line(result, option)
    assert not (tiny.dir / "never.lz").exists() and not (tiny.dir / "never-repo").exists()


@pytest.mark.parametrize(
    "shape", ["input_ids:99999999999,99999999999", "input_ids:1," + "9" * 300, "input_ids:65536,65536"]
)
def test_huge_shape_is_refused(shape: str, tiny: SimpleNamespace, helpers: SimpleNamespace) -> None:
    result = helpers.run_cli("compile", tiny.source, "-o", tiny.dir / "never.lz", "--shape", shape)
    helpers.one_line(result, "--shape", "too large")


def test_bad_segment_values(tiny: SimpleNamespace, helpers: SimpleNamespace) -> None:
    for item in ("chat:sample_rate=nan", "chat:threshold=-1", "chat:sample_rate=2"):
        result = helpers.run_cli("serve", tiny.bundle, "--segment", item, "--port-http", "1", "--port-grpc", "2")
        helpers.one_line(result, "--segment")


def test_good_numbers_still_parse() -> None:
    from layerzero.cli import build_parser

    args = build_parser().parse_args(["compile", "m.onnx", "-o", "x", "--atol", "0", "--threshold", "1",
                                      "--seed", "4294967295"])  # fmt: skip
    assert (args.atol, args.threshold, args.seed) == (0.0, 1.0, 2**32 - 1)
    args = build_parser().parse_args(["serve", "b", "--port-http", "65535", "--port-metrics", "0"])
    assert (args.port_http, args.port_metrics) == (65535, 0)
