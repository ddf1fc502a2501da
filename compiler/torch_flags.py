"""Add a zero flag to a PyTorch module before export: ``add_flag(model.model.layers[3])``.

The flag is a buffer named ``flag`` on the module, so the export names it ``<module path>.flag``
(``model.layers.3.flag``), and the module's output becomes ``Where(flag > 0.5, f(x), x)``: the *consumed*
form of README "Zero flags". The exporters drop a buffer nothing reads, so the flag has to be computed with
to reach the ONNX file; with the flag 0 the compiler's constant propagation takes the module out, with 1 it
folds the ``Where`` away and the module stays, unchanged (``Where`` selects, it does not round).

The module must map its first input (or ``hidden_states``) to an output of the same shape: a residual
layer, as Hugging Face decoder layers are. A tuple output (older transformers) has its first element switched.
"""

from __future__ import annotations

from typing import Any

from layerzero.errors import InvalidInputError

__all__ = ["FLAG_BUFFER", "add_flag"]

FLAG_BUFFER = "flag"


def add_flag(module: Any, value: float = 0.0, *, name: str = FLAG_BUFFER) -> Any:
    """Register a one-element float32 buffer ``name`` (= ``value``) on ``module`` and switch its output by it.

    Returns the forward-hook handle (``handle.remove()`` takes the switch away; the buffer stays).

    Raises:
        InvalidInputError: ``module`` is not a torch module, already has ``name``, or ``value`` is not 0 or 1.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise InvalidInputError(f"add_flag: expected a torch.nn.Module, got {type(module).__name__}")
    if value not in (0, 1):
        raise InvalidInputError(f"add_flag: value {value!r} must be 0 (layer off) or 1 (layer on)")
    if hasattr(module, name):
        raise InvalidInputError(f"add_flag: {type(module).__name__} already has an attribute {name!r}")
    module.register_buffer(name, torch.tensor([float(value)], dtype=torch.float32))

    def switch(mod: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        x = args[0] if args else kwargs.get("hidden_states")
        out = output[0] if isinstance(output, tuple) else output
        if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.shape != out.shape:
            raise InvalidInputError(
                f"add_flag: {type(mod).__name__} must map its first input to an output of the same shape "
                "(a residual layer)"
            )
        gated = torch.where(getattr(mod, name) > 0.5, out, x)  # Where(flag > 0.5, f(x), x)
        return (gated, *output[1:]) if isinstance(output, tuple) else gated

    return module.register_forward_hook(switch, with_kwargs=True)
