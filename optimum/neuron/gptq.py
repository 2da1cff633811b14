"""GPTQ (``--quantization_method gptq``): the integer values and scales of the quantized layers chosen against
calibration text, in the export's own scheme and stored form.

Round to nearest (`quantization.quantize`, the default ``rtn``) treats each weight alone. GPTQ (Frantar et al.,
2022) quantizes a layer's input columns one at a time and spreads each column's rounding error over the columns
not yet quantized, in proportion to how the layer's inputs correlate (the inverse of ``H = X^T X`` over the
calibration inputs ``X``), so that the layer's outputs on such inputs change least. What this module does, exactly:

* **calibration text**: the docstrings of the Python standard library's modules, classes and functions (read from
  their source with `ast`, no import and no download), `SEQUENCES` sequences of `TOKENS` tokens;
* **layer by layer**: the float model (transformers, fp32) runs the calibration sequences up to a decoder layer;
  that layer's inputs give each linear layer's ``H``; its linear layers are quantized; the layer's outputs with the
  quantized weights are the next layer's inputs (errors of earlier layers are seen by later ones);
* **scales**: each group's (int4) or row's (int8) scale is the scheme's (`quantization.base_scale`: symmetric, or
  ``--int4_range full``) times the factor in ``1, ..., SMALLEST_FACTOR`` (`FACTORS` steps) whose rounded weights
  have the least squared error weighted by ``diag(H)`` (a smaller scale clips a group's outliers to keep its other
  weights finer); fixed before the values are chosen;
* **values**: columns in decreasing order of ``diag(H)``, each rounded with its group's scale into the scheme's
  range, ``H`` damped by `DAMPING` x its mean diagonal, in blocks of `BLOCK` columns.

The artifact stores ``q`` and ``scale`` exactly as a round-to-nearest export does (same graphs, kernels and bytes):
transformers running the model whose quantized weights are replaced by ``q * scale`` computes what the artifact
computes. The LM head (``--lm_head_format int8``) is rounded to nearest.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import NeuronConfig
from .errors import ExportError
from .quantization import HEADS, base_scale, dequantize, layer_format, quantized_layers, round_to, store

SEQUENCES = 128
"""Calibration sequences."""
TOKENS = 512
"""Tokens per calibration sequence."""
DAMPING = 0.01
"""``H`` gets this fraction of its mean diagonal added to its diagonal (numerical stability)."""
BLOCK = 128
"""Columns quantized between two updates of the remaining ones."""
FACTORS = 40
"""Candidate scales per group: the scheme's times ``1 - (1 - SMALLEST_FACTOR) k / FACTORS``, k = 0 .. FACTORS."""
SMALLEST_FACTOR = 0.6
"""The smallest fraction of the scheme's scale a group may take."""
Report = Callable[[str], None]
"""Where progress goes (a `progress.Line`'s ``update``)."""


class CalibrationError(ExportError):
    """GPTQ cannot calibrate this model: what is missing, and how to export it otherwise."""


def calibration_text() -> str:
    """The docstrings (over 200 characters) of the standard library's top-level modules, in file and source order."""
    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs += [
            doc
            for node in ast.walk(tree)
            if isinstance(node, kinds) and len(doc := ast.get_docstring(node) or "") > 200
        ]
    return "\n\n".join(docs)


def calibration_ids(tokenizer: Any, sequences: int = SEQUENCES, tokens: int = TOKENS) -> torch.Tensor:
    """``[sequences, tokens]`` token ids of `calibration_text`, consecutive."""
    ids = tokenizer(calibration_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < sequences * tokens:
        raise CalibrationError(
            f"the calibration text has {len(ids)} tokens with this tokenizer, fewer than {sequences} x {tokens}: "
            "export with --quantization_method rtn."
        )
    return torch.tensor(ids[: sequences * tokens]).reshape(sequences, tokens)


def searched_scale(
    weight: torch.Tensor, fmt: str, group: int, int4_range: str, importance: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """The scale ``[N, K / group]`` of each group of ``weight [N, K]`` and the range of ``q``: the scheme's scale
    (`quantization.base_scale`) times the factor of `FACTORS` whose rounded group has the least squared error, column
    ``j`` weighted by ``importance[j]``."""
    rows, columns = weight.shape
    grouped = weight.float().reshape(rows, columns // group, group)
    scale, low, high = base_scale(grouped, fmt, int4_range)
    weights = importance.float().reshape(1, columns // group, group)
    best, least = scale, torch.full_like(scale, float("inf"))
    for k in range(FACTORS + 1):
        candidate = scale * (1 - (1 - SMALLEST_FACTOR) * k / FACTORS)
        q = round_to(grouped, candidate[..., None], low, high)
        error = (((grouped - q * candidate[..., None]) ** 2) * weights).sum(dim=-1)
        better = error < least
        best, least = torch.where(better, candidate, best), torch.where(better, error, least)
    return best, low, high


def gptq(
    weight: torch.Tensor, hessian: torch.Tensor, fmt: str, group: int, int4_range: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [N, K], scale float32 [N, K / group])`` of ``weight [N, K]`` for inputs whose ``X^T X`` is
    ``hessian [K, K]`` (the module docstring's rule)."""
    rows, columns = weight.shape
    hessian = hessian.double().clone()
    unused = torch.diag(hessian) == 0
    hessian[unused, unused] = 1  # an input that is always 0: its column is rounded to nearest
    scale, low, high = searched_scale(weight, fmt, group, int4_range, torch.diag(hessian))
    order = torch.argsort(torch.diag(hessian), descending=True, stable=True)
    inverse = _inverse_factor(hessian[order][:, order]).float()
    work = weight.float()[:, order].clone()
    column_scale = scale.repeat_interleave(group, dim=1)[:, order]
    q = torch.empty(rows, columns, dtype=torch.int8)
    for start in range(0, columns, BLOCK):
        end = min(start + BLOCK, columns)
        errors = torch.empty(rows, end - start)
        for j in range(start, end):
            s = column_scale[:, j]
            value = round_to(work[:, j], s, low, high)
            q[:, j] = value.to(torch.int8)
            errors[:, j - start] = (work[:, j] - value * s) / inverse[j, j]
            work[:, j + 1 : end] -= errors[:, j - start, None] * inverse[j, j + 1 : end]
        work[:, end:] -= errors @ inverse[start:end, end:]
    return q[:, torch.argsort(order)].contiguous(), scale


def _inverse_factor(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of ``(hessian + damping)^-1`` (float64), damping raised tenfold until it is positive
    definite."""
    mean = float(torch.diag(hessian).mean())
    for damping in (DAMPING, DAMPING * 10, DAMPING * 100):
        damped = hessian + damping * mean * torch.eye(len(hessian), dtype=hessian.dtype)
        factor, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True)
    raise CalibrationError(
        "a layer's input correlation is not positive definite: export with --quantization_method rtn."
    )


@torch.no_grad()
def calibrate(
    model_dir: Path, hf_config: Any, stored: dict[str, torch.Tensor], config: NeuronConfig, report: Report
) -> dict[str, torch.Tensor]:
    """The stored values and scales GPTQ chooses, on the float checkpoint in ``model_dir``, for every quantized
    decoder layer of ``stored`` (the artifact's weight set, rounded to nearest; the LM head is left out: rounded)."""
    layers = [name for name in quantized_layers(stored) if name not in HEADS]
    model = _float_model(model_dir, hf_config)
    blocks = _decoder_layers(model)
    ids = calibration_ids(_tokenizer(model_dir), *_calibration_shape(hf_config))
    hidden, arguments = _layer_inputs(model, blocks, ids, report)
    calibrated: dict[str, torch.Tensor] = {}
    for index, block in enumerate(blocks):
        report(f"layer {index + 1}/{len(blocks)}")
        names = [name for name in layers if name.startswith(f"model.layers.{index}.")]
        linears = {
            name: _linear(block, name.removeprefix(f"model.layers.{index}."), stored[f"{name}.weight"])
            for name in names
        }
        hessians = _hessians(block, linears, hidden, arguments[index])
        for name, linear in linears.items():
            fmt = layer_format(config, name)
            group = config.weight_group_size if fmt == "int4" else linear.in_features
            q, scale = gptq(linear.weight.detach(), hessians[name], fmt, group, config.int4_range)
            linear.weight.data = dequantize(q, scale).to(linear.weight.dtype)
            store(calibrated, name, fmt, q, scale)
        hidden = [_output(block(x, **arguments[index])) for x in hidden]
    return calibrated


def _calibration_shape(hf_config: Any) -> tuple[int, int]:
    """``(sequences, tokens)``: `SEQUENCES` x `TOKENS`, in more, shorter sequences for a model whose positions end
    before `TOKENS`."""
    from .models.registry import language_config

    tokens = min(TOKENS, getattr(language_config(hf_config), "max_position_embeddings", TOKENS) or TOKENS)
    return SEQUENCES * TOKENS // tokens, tokens


def _float_model(model_dir: Path, hf_config: Any) -> nn.Module:
    """The checkpoint as transformers runs it, in float32 on the CPU."""
    import transformers

    from .models.registry import image_text_family

    kind = (
        transformers.AutoModelForImageTextToText if image_text_family(hf_config) else transformers.AutoModelForCausalLM
    )
    return kind.from_pretrained(model_dir, dtype=torch.float32).eval()


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise CalibrationError(
            f"GPTQ tokenizes its calibration text with the checkpoint's tokenizer, and {model_dir} has none that "
            f"transformers reads ({err}): add the tokenizer files, or export with --quantization_method rtn."
        ) from err


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's layers of transformers' ``model``."""
    decoder = model.get_decoder()  # type: ignore[operator]
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise CalibrationError(
            f"{type(model).__name__} has no decoder layers GPTQ can run one by one: export with "
            "--quantization_method rtn."
        )
    return layers


def _linear(block: nn.Module, suffix: str, stored: torch.Tensor) -> nn.Linear:
    """The linear layer ``suffix`` of transformers' decoder layer ``block``: the stored layer's twin."""
    module = block.get_submodule(suffix)
    if not isinstance(module, nn.Linear) or module.out_features != stored.shape[0]:
        raise CalibrationError(
            f"transformers' layer {suffix!r} is not the linear layer the artifact stores: export with "
            "--quantization_method rtn."
        )
    return module


class _Stop(Exception):
    """Ends a calibration forward pass once the inputs it was run for are seen."""


def _layer_inputs(
    model: nn.Module, blocks: nn.ModuleList, ids: torch.Tensor, report: Report
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The first decoder layer's input for each calibration sequence, and each layer's other arguments (the same
    for every sequence of one length: positions, masks), from the float model."""
    hidden: list[torch.Tensor] = []
    arguments: list[dict[str, Any]] = [{} for _ in blocks]
    captured = [False] * len(blocks)

    def seen(index: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            if index == 0:
                hidden.append(x.detach())
            if not captured[index]:
                arguments[index] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                captured[index] = True
            if index == len(blocks) - 1 or all(captured):
                raise _Stop

        return hook

    hooks = [block.register_forward_pre_hook(seen(index), with_kwargs=True) for index, block in enumerate(blocks)]
    with _removed(hooks), torch.no_grad():
        for row in range(len(ids)):
            report(f"inputs {row + 1}/{len(ids)}")
            with suppress(_Stop):
                model(input_ids=ids[row : row + 1], use_cache=False)
    return hidden, arguments


@contextmanager
def _removed(handles: list[Any]) -> Iterator[None]:
    """Hold the hooks of ``handles`` (torch's removable handles) for the ``with`` block, then remove them."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hessians(
    block: nn.Module, linears: dict[str, nn.Linear], hidden: list[torch.Tensor], arguments: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """``X^T X`` (float64) of each of ``linears``' inputs over the calibration sequences through ``block`` (layers
    reading the same input share one product)."""
    sums: dict[str, torch.Tensor] = {}
    products: dict[int, torch.Tensor] = {}

    def hook_of(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            key = id(x)
            if key not in products:
                flat = x.detach().reshape(-1, x.shape[-1]).float()
                products[key] = (flat.T @ flat).double()
                products[-key - 1] = x  # keeps x alive, so its id is not reused within this pass
            sums[name] = sums.get(name, 0) + products[key]

        return hook

    with _removed([linear.register_forward_pre_hook(hook_of(name)) for name, linear in linears.items()]):
        for x in hidden:
            products.clear()
            block(x, **arguments)
    return sums


def _output(result: Any) -> torch.Tensor:
    """A decoder layer's hidden states (transformers' layers return them alone or first in a tuple)."""
    return (result[0] if isinstance(result, tuple) else result).detach()
