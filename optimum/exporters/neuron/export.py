"""Export: HF checkpoint folder + `NeuronConfig` -> artifact directory (one compiled graph per kind).

Two caches under ``$OPTIMUM_NEURON_CACHE``: whole artifacts in ``exports/<key>``, the key hashing the config, the
model files and the toolkit's code (a repeated export with the same inputs is a hit), and each compiled graph in
``graphs/<key>`` (`graph_cache`), taken by every export that needs the same graph.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from ...neuron.artifact import GRAPHS_DIR, WEIGHTS_FILE, graph_file, head_record, sha256_of, write_manifest
from ...neuron.backends import get_backend
from ...neuron.cache_admin import CALIBRATED, EXPORTS
from ...neuron.cache_dir import cache_lock, cache_root
from ...neuron.config import CONFIG_FILE, NeuronConfig
from ...neuron.errors import WeightLoadingError
from ...neuron.gptq import calibrate
from ...neuron.graphs import GraphSpec, graph_fields, graph_specs, window_spans
from ...neuron.models.image_text import fit_images
from ...neuron.models.registry import image_text_family
from ...neuron.prequantized import without_quantization_config
from ...neuron.progress import Line, StepProgress
from ...neuron.quantization import fit_weight_format
from .cache import code_fingerprint
from .compile import (
    GraphBuilder,
    artifact_weights,
    compile_graphs,
    helpers_for,
    hf_config_of,
    start_workers,
    worker_count,
)
from .graph_cache import GraphCache, graph_key
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
        _check_inputs(model_dir, config)
        _build(model_dir, output_dir, config, None)
        return output_dir
    cached_export(model_dir, config, copy_to=output_dir)
    return output_dir


def cached_export(model_dir: str | Path, config: NeuronConfig, copy_to: Path | None = None) -> Path:
    """The export cache's artifact of ``model_dir`` under ``config``, built on first use (one process builds,
    concurrent ones wait for it). Read it, never write into it: `export` gives a private copy (``copy_to``, made
    under the entry's lock, so that ``optimum-cli neuron cache prune`` cannot remove it halfway)."""
    model_dir = Path(model_dir)
    _check_inputs(model_dir, config)
    key = config.cache_key(f"{model_fingerprint(model_dir)}:{code_fingerprint()}")
    cached = cache_root() / EXPORTS / key
    with cache_lock(cached.with_name(f"{key}.lock")):
        if (cached / CONFIG_FILE).is_file():
            from rich.console import Console

            Console(stderr=True).print(f"[green]export cache hit[/green] {cached}")
            os.utime(cached)  # its last use (`optimum-cli neuron cache list`, `prune`)
        else:
            _build_entry(model_dir, config, cached)
        if copy_to is not None and copy_to.resolve() != cached.resolve():
            _copy_tree(cached, copy_to)
    return cached


def _build_entry(model_dir: Path, config: NeuronConfig, cached: Path) -> None:
    """Build the artifact cache's entry ``cached`` (its lock held): in a private folder, renamed when whole."""
    staging = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _build(model_dir, staging, config, GraphCache.default())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a failed export leaves nothing in the cache
        raise
    shutil.rmtree(cached, ignore_errors=True)
    staging.rename(cached)


def _check_inputs(model_dir: Path, config: NeuronConfig) -> None:
    """Refuse an unavailable backend or device, then a folder that is no checkpoint."""
    get_backend(config.backend).placement(config.device)
    if not (model_dir / "config.json").is_file():
        raise WeightLoadingError(
            f"{model_dir} is not a transformers checkpoint folder (no config.json there): point --model at a "
            "local folder written by save_pretrained."
        )


def _copy_tree(source: Path, target: Path) -> None:
    """Copy (not link) the cached artifact: editing the output must never alter the cache."""
    shutil.copytree(source, target, dirs_exist_ok=True, copy_function=_replace_file)


def _replace_file(source: str, target: str) -> str:
    """Copy a file over ``target`` without writing through it: an old hard link stays untouched."""
    Path(target).unlink(missing_ok=True)
    return shutil.copy2(source, target)


def _build(model_dir: Path, out: Path, config: NeuronConfig, graphs: GraphCache | None) -> None:
    """Write the artifact of ``model_dir`` under ``config`` into ``out``: every graph taken from the per-graph cache
    ``graphs`` or compiled (in parallel processes where the backend allows, `compile.compile_graphs`) and stored
    there; with no cache (``--no_cache``), compiled straight into ``out``."""
    backend = get_backend(config.backend)
    hf_config = hf_config_of(model_dir)
    config = fit_weight_format(fit_images(config, image_text_family(hf_config), hf_config, model_dir), hf_config)
    specs = graph_specs(config)
    folder = out / GRAPHS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    ranks = f", {config.tp_degree} tensor-parallel ranks" if config.tp_degree > 1 else ""
    title = f"export {model_dir.name} ({config.backend}, {config.device}{ranks})"
    record = _entry_record(model_dir, config, hf_config)
    steps = 2 + len(specs) + (config.quantization_method == "gptq")
    with StepProgress(title, steps) as bar, tracing_group(config.tp_degree), ExitStack() as held:
        # workers start before the graphs are looked up: they import while the keys are computed (inductor's first
        # check of the CPU's vector ISA compiles test programs for seconds, unless the CLI started it earlier)
        workers = start_workers(worker_count(len(specs), config, model_dir), model_dir, config, held)
        keys = {spec.name: graph_key(spec, config, hf_config, backend) for spec in specs}
        lines = {spec.name: bar.line(f"{spec.name} {_shape(spec)}") for spec in specs}
        jobs, waiting = _plan(specs, keys, graphs, held, lines, folder)
        workers = helpers_for(jobs, workers)
        staged = {spec.name: job_folder for spec, job_folder in jobs}
        loaded: dict[str, Any] = {}

        def load() -> GraphBuilder:
            with bar.step("load checkpoint"):
                loaded["builder"], loaded["weights"] = GraphBuilder.load(model_dir, config)
            return loaded["builder"]

        def done(spec: GraphSpec, seconds: float) -> None:
            if graphs is not None:
                _store(graphs, keys[spec.name], staged[spec.name], {**record, "graph": spec.name}, seconds, folder)
            lines[spec.name].finish(f"compiled in {seconds:.1f}s")

        if jobs or waiting:
            compile_graphs(jobs, load, workers, done)
        else:  # every graph cached: the weights the artifact stores, without the decoder the graphs were traced from
            with bar.step("read checkpoint"):
                loaded["weights"] = artifact_weights(hf_config, model_dir, config)
        for spec in waiting:  # graphs another export was compiling: taken once it is done, compiled if it failed
            assert graphs is not None
            _take_or_compile(graphs, keys[spec.name], spec, loaded["builder"], record, folder, lines[spec.name])
        weights = loaded["weights"]
        if config.quantization_method == "gptq":
            weights = {**weights, **_calibrated(model_dir, hf_config, weights, config, bar.line("calibrate (GPTQ)"))}
        with bar.step("write artifact"):
            save_file({k: v.cpu() for k, v in weights.items()}, str(out / WEIGHTS_FILE))
            files = {spec.name: graph_file(spec.name, backend.suffix) for spec in specs}
            write_manifest(out, files, weights, keys, window_spans(specs))
            _copy_hf_files(model_dir, out, hf_config)
            recorded = head_record(hf_config, config)
            (out / CONFIG_FILE).write_text(config.to_json([spec.name for spec in specs], recorded))


def _calibrated(
    model_dir: Path, hf_config: Any, weights: dict[str, Any], config: NeuronConfig, line: Line
) -> dict[str, Any]:
    """GPTQ's values and scales for the quantized layers of ``weights`` (`gptq.calibrate`), kept in the calibration
    cache under a key of the checkpoint, the code and the quantization fields: another export of the same checkpoint
    and quantization (another batch size, sequence length, backend) takes them."""
    fields = ("weight_format", "weight_group_size", "int4_range", "quantization_method")
    payload = {
        "model": model_fingerprint(model_dir),
        "code": code_fingerprint(),
        "quantization": {name: getattr(config, name) for name in fields},
    }
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / CALIBRATED / f"{key}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(path.with_name(f"{path.name}.lock")):
        if path.is_file():
            line.finish("cached")
            return load_file(str(path))
        chosen = calibrate(model_dir, hf_config, weights, config, line.update)
        staging = path.with_name(f"{path.name}.tmp{os.getpid()}")
        save_file(chosen, str(staging))
        staging.rename(path)
    line.finish()
    return chosen


def _plan(
    specs: tuple[GraphSpec, ...],
    keys: dict[str, str],
    graphs: GraphCache | None,
    held: ExitStack,
    lines: dict[str, Line],
    folder: Path,
) -> tuple[list[tuple[GraphSpec, Path]], list[GraphSpec]]:
    """Sort the graphs of an export: those already cached are taken into ``folder`` now; those to compile here become
    jobs (their entry's lock taken and a staging folder made, both released by ``held``); those another process is
    compiling right now are returned, to wait for once this export's own compiles are done (so that two exports never
    wait on each other)."""
    if graphs is None:
        return [(spec, folder) for spec in specs], []
    jobs, waiting = [], []
    for spec in specs:
        key = keys[spec.name]
        if graphs.take(key, folder):
            lines[spec.name].finish("cached")
        elif not held.enter_context(graphs.lock(key, wait=False)):
            waiting.append(spec)
        elif graphs.take(key, folder):  # compiled by another export between the two checks
            lines[spec.name].finish("cached")
        else:
            jobs.append((spec, held.enter_context(graphs.staging(key))))
    return jobs, waiting


def _take_or_compile(
    graphs: GraphCache, key: str, spec: GraphSpec, builder: GraphBuilder, record: dict, folder: Path, line: Line
) -> None:
    """Wait for the process compiling ``key``'s graph, then take it; compile it here when that process failed."""
    with graphs.lock(key):
        if graphs.take(key, folder):
            line.finish("cached: compiled by another export")
            return
        with graphs.staging(key) as staging:
            seconds = builder.compile(spec, staging)
            _store(graphs, key, staging, {**record, "graph": spec.name}, seconds, folder)
        line.finish(f"compiled in {seconds:.1f}s")


def _store(graphs: GraphCache, key: str, staging: Path, record: dict, seconds: float, folder: Path) -> None:
    """Make a graph compiled into ``staging`` the cache entry ``key`` (its lock held) and take it into ``folder``."""
    graphs.commit(key, staging, {**record, "compile_seconds": round(seconds, 2)})
    assert graphs.take(key, folder), "an entry vanished under its lock"


def _entry_record(model_dir: Path, config: NeuronConfig, hf_config: Any) -> dict[str, Any]:
    """What a graph cache entry records of the export that compiled it (``optimum-cli neuron cache list``)."""
    return {
        "model": model_dir.name,
        "model_type": getattr(hf_config, "model_type", "?"),
        "backend": config.backend,
        "device": config.device,
        "config": graph_fields(config),
    }


def _shape(spec: GraphSpec) -> str:
    if spec.image_size:
        return f"[{spec.batch}, 3, {spec.image_size}, {spec.image_size}]"
    windows = ", ".join(map(str, spec.windows))
    tokens = f"{spec.chunks[0]}..{spec.tokens}" if spec.symbolic_chunk else str(spec.tokens)
    return f"[{spec.batch}, {tokens}]" + (f" KV windows {windows}" if spec.windows else "")


def _copy_hf_files(model_dir: Path, out: Path, hf_config: Any) -> None:
    """The model's config (without a pre-quantized checkpoint's quantization_config: the artifact stores its own form,
    recorded in neuron_config.json) and tokenizer files, into the artifact ``out``."""
    without_quantization_config(hf_config).save_pretrained(out)
    for name in _HF_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
