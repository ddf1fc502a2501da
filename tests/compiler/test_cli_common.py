"""The verbs' shared flags (``compiler/cli/_common.py``): each verb parses them with the one definition's
type, default and choices."""

from __future__ import annotations

import pytest

from layerzero.cli import build_parser
from layerzero.options import DEVICES, MOE_LOWERINGS, STABILITY_UNITS, CompileOptions


def _parse(*argv: str):
    return build_parser(list(argv)).parse_args(list(argv))


def _choices(verb: str, flag: str) -> tuple[str, ...]:
    parser = build_parser([verb, "x"])
    sub = next(a for a in parser._actions if a.dest == "verb").choices[verb]
    return tuple(next(a for a in sub._actions if flag in a.option_strings).choices)


def test_compile_takes_its_defaults_from_compile_options() -> None:
    args = _parse("compile", "m.onnx", "-o", "m.lz")
    defaults = CompileOptions()
    assert (args.device, args.moe_lowering, args.flag_pattern) == (
        defaults.device,
        defaults.moe_lowering,
        defaults.flag_pattern,
    )
    assert (args.impact_tolerance, args.stability_window, args.stability_unit) == (
        defaults.impact_tolerance,
        defaults.stability_window,
        defaults.stability_unit,
    )
    assert args.force is False
    assert _choices("compile", "--moe-lowering") == MOE_LOWERINGS
    assert _choices("compile", "--device") == _choices("run", "--device") == _choices("serve", "--device") == DEVICES
    assert _choices("compile", "--stability-unit") == _choices("report", "--stability-unit") == STABILITY_UNITS


def test_report_defaults_are_compiles() -> None:
    # The report's table says what `compile --profile` does, so its window defaults to compile's.
    args = _parse("report", "p.json", "-o", "map.html")
    assert args.stability_window == CompileOptions.stability_window and args.impact_tolerance == 0.01
    assert args.stability_unit == "requests"
    args = _parse("report", "p.json", "-o", "map.html", "--stability-window", "7", "--force")
    assert args.stability_window == 7 and args.force is True


@pytest.mark.parametrize("verb", ["serve", "triton-export"])
def test_the_guard_flags_mean_the_same_in_serve_and_triton_export(verb: str) -> None:
    positional = ["m.lz"] if verb == "serve" else ["m.lz", "repo"]
    args = _parse(verb, *positional)
    assert (args.reference, args.no_reference, args.sample_rate, args.fallback_bound, args.max_tokens) == (
        None,
        False,
        None,
        0.05,
        None,
    )
    args = _parse(verb, *positional, "--sample-rate", "0.5", "--max-tokens", "9", "--no-reference")
    assert (args.sample_rate, args.max_tokens, args.no_reference) == (0.5, 9, True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compile", "m.onnx", "-o", "m.lz", "--moe-lowering", "fast"], "invalid choice: 'fast'"),
        (["run", "m.lz", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["serve", "m.lz", "--sample-rate", "2"], "--sample-rate"),
        (["report", "p.json", "-o", "m.html", "--stability-window", "0"], "--stability-window"),
    ],
)
def test_a_bad_shared_flag_is_one_line_and_exit_2(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(*argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
