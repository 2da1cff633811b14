"""Export: HF checkpoint folder + `NeuronConfig` -> artifact directory (one compiled graph per kind).

Exports are cached under ``$OPTIMUM_NEURON_CACHE/exports/<key>``, the key hashing the config, the
model files and the toolkit's code; a repeated export with the same inputs is a cache hit.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ...neuron.artifact import (
    GRAPHS_DIR,
    WEIGHTS_FILE,
    allocate_cache,
    assemble,
    empty_decoder,
    graph_file,
    graph_weights,
    head_record,
    sha256_of,
    write_manifest,
)
from ...neuron.backends import get_backend
from ...neuron.cache_dir import cache_lock, cache_root
from ...neuron.config import CONFIG_FILE, NeuronConfig
from ...neuron.errors import UnsupportedModelError, WeightLoadingError
from ...neuron.graphs import GraphSpec, example_inputs, graph_args, graph_specs, image_row_inputs, window_dims
from ...neuron.models.base import StaticDecoder, graph_module
from ...neuron.models.image_text import fit_images
from ...neuron.models.registry import image_text_family, language_config, served_config, supported_model_types
from ...neuron.progress import StepProgress
from ...neuron.weights import constants_of, map_state_dict, read_checkpoint
from .cache import code_fingerprint
from .parallel import tracing_group

_HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "chat_template.json",
)


def model_fingerprint(model_dir: Path) -> str:
    """Hash of a checkpoint folder's config and weight files (content, not names or times)."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and (path.suffix in (".json", ".safetensors", ".bin", ".jinja", ".txt", ".model")):
            digest.update(path.name.encode() + sha256_of(path).encode())
    return digest.hexdigest()[:16]


def export(model_dir: str | Path, output_dir: str | Path, config: NeuronConfig, use_cache: bool = True) -> Path:
    """Export ``model_dir`` under ``config`` into ``output_dir`` (a copy of the export cache's entry, built
    on first use, unless ``use_cache`` is false)."""
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    if not use_cache:
        device = _checked_inputs(model_dir, config)
        _build(model_dir, output_dir, config, device)
        return output_dir
    cached = cached_export(model_dir, config)
    if output_dir.resolve() != cached.resolve():
        _copy_tree(cached, output_dir)
    return output_dir


def cached_export(model_dir: str | Path, config: NeuronConfig) -> Path:
    """The export cache's artifact of ``model_dir`` under ``config``, built on first use (one process builds,
    concurrent ones wait for it). Read it, never write into it: `export` gives a private copy."""
    model_dir = Path(model_dir)
    device = _checked_inputs(model_dir, config)
    key = config.cache_key(f"{model_fingerprint(model_dir)}:{code_fingerprint()}")
    cached = cache_root() / "exports" / key
    with cache_lock(cached.with_name(f"{key}.lock")):
        if (cached / CONFIG_FILE).is_file():
            from rich.console import Console

            Console(stderr=True).print(f"[green]export cache hit[/green] {cached}")
            return cached
        staging = cached.with_name(f"{key}.tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _build(model_dir, staging, config, device)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # a failed export leaves nothing in the cache
            raise
        shutil.rmtree(cached, ignore_errors=True)
        staging.rename(cached)
    return cached


def _checked_inputs(model_dir: Path, config: NeuronConfig) -> str | torch.device:
    """The device to build on; refuses an unavailable backend or device, then a folder that is no checkpoint."""
    device = get_backend(config.backend).placement(config.device)
    if not (model_dir / "config.json").is_file():
        raise WeightLoadingError(
            f"{model_dir} is not a transformers checkpoint folder (no config.json there): point --model at a "
            "local folder written by save_pretrained."
        )
    return device


def _copy_tree(source: Path, target: Path) -> None:
    """Copy (not link) the cached artifact: editing the output must never alter the cache."""
    shutil.copytree(source, target, dirs_exist_ok=True, copy_function=_replace_file)


def _replace_file(source: str, target: str) -> str:
    """Copy a file over ``target`` without writing through it: an old hard link stays untouched."""
    Path(target).unlink(missing_ok=True)
    return shutil.copy2(source, target)


def _build(model_dir: Path, out: Path, config: NeuronConfig, device: str | torch.device) -> None:
    backend = get_backend(config.backend)
    hf_config = _hf_config(model_dir)
    config = fit_images(config, image_text_family(hf_config), hf_config, model_dir)
    specs = graph_specs(config)
    (out / GRAPHS_DIR).mkdir(parents=True, exist_ok=True)
    ranks = f", {config.tp_degree} tensor-parallel ranks" if config.tp_degree > 1 else ""
    title = f"export {model_dir.name} ({config.backend}, {config.device}{ranks})"
    with StepProgress(title, 2 + len(specs)) as bar, tracing_group(config.tp_degree):
        with bar.step("load checkpoint"):
            decoder, weights = load_decoder(hf_config, model_dir, config, device)
            kv_cache = allocate_cache(hf_config, config, device)
        files: dict[str, str] = {}
        for spec in specs:
            files[spec.name] = graph_file(spec.name, backend.suffix)
            with bar.step(f"trace + compile {spec.name} {_shape(spec)}"):
                inputs = {k: v.to(device) for k, v in _example_inputs(spec, hf_config, config).items()}
                args = graph_args(spec.kind, inputs, kv_cache)
                backend.compile(graph_module(decoder, spec).eval(), args, out / files[spec.name], window_dims(spec))
        with bar.step("write artifact"):
            save_file({k: v.cpu() for k, v in weights.items()}, str(out / WEIGHTS_FILE))
            write_manifest(out, files, weights)
            _copy_hf_files(model_dir, out, hf_config)
            recorded = head_record(hf_config, config)
            (out / CONFIG_FILE).write_text(config.to_json([spec.name for spec in specs], recorded))


def _hf_config(model_dir: Path) -> Any:
    """The config of the decoder to export (`served_config`: a multimodal checkpoint's text decoder); an
    architecture transformers does not know is unsupported."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except ValueError as err:  # transformers' error for an unknown model_type
        raise UnsupportedModelError(
            f"transformers cannot read {model_dir / 'config.json'} ({str(err).splitlines()[0]}); supported model "
            f"types: {', '.join(supported_model_types())}."
        ) from err
    return served_config(config)


def load_decoder(
    hf_config: Any, model_dir: Path, config: NeuronConfig, device: str | torch.device | None = None
) -> tuple[StaticDecoder, dict]:
    """The static decoder of ``model_dir`` with its strictly mapped weights, on ``device`` (default
    ``config.device``; the xla backend passes its XLA device, see `Backend.placement`). The weights are the full
    set (what the artifact stores); at ``tp_degree > 1`` the decoder is rank 0's, bound to its slice of them (every
    rank runs the same graph)."""
    layout = empty_decoder(hf_config, config.derive(tp_degree=1))
    params = map_state_dict(layout, read_checkpoint(model_dir), config.torch_dtype)
    weights = {k: v.to(device or config.device) for k, v in constants_of(layout, params).items()}
    return assemble(hf_config, config, graph_weights(hf_config, config, weights)), weights


def _example_inputs(spec: GraphSpec, hf_config: Any, config: NeuronConfig) -> dict[str, torch.Tensor]:
    """The tracing inputs of graph ``spec``, with the image rows of an image-text prefill graph."""
    inputs = example_inputs(spec)
    if spec.images:
        inputs.update(image_row_inputs(spec, language_config(hf_config).hidden_size, config.torch_dtype))
    return inputs


def _shape(spec: GraphSpec) -> str:
    if spec.image_size:
        return f"[{spec.batch}, 3, {spec.image_size}, {spec.image_size}]"
    windows = ", ".join(map(str, spec.windows))
    return f"[{spec.batch}, {spec.tokens}]" + (f" KV windows {windows}" if spec.windows else "")


def _copy_hf_files(model_dir: Path, out: Path, hf_config: Any) -> None:
    hf_config.save_pretrained(out)
    for name in _HF_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
