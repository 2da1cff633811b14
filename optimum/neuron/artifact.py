"""The artifact: its layout, its manifest, opening and verifying it, and assembling what its graphs
run on. The exporter writes it and the runtime reads it; both go through this module only.

An artifact directory holds::

    config.json, generation_config.json, tokenizer files    (transformers)
    neuron_config.json                                      (NeuronConfig + versions + graph list)
    model.safetensors                                       (the one weight set, target dtype)
    graphs/<name><suffix>                                   (one compiled graph per GraphSpec)
    graphs/manifest.json                                    (sha256 and cache key of each graph, weight shapes)

*Assembling* is the same for export and run: the static decoder is built on the meta device (no
memory) and bound to the one weight set without a copy; the one KV cache is allocated for the
artifact's batch and sequence length.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .config import CONFIG_FILE, NeuronConfig, load_config_file
from .errors import ArtifactError, IncompatibleConfigError
from .graphs import graph_specs
from .kernels import library as kernel_library
from .kernels import packed as packed_kernel
from .kernels.huge_pages import on_huge_pages
from .models.base import StaticDecoder
from .models.layers.attention import attention_dims
from .models.layers.kv_cache import allocate_kv_cache
from .models.layers.lora import add_lora, lora_weights
from .models.layers.packed import pack_decoder, packed_weights
from .models.layers.parallel import head_layout, rank_config, shard_weights
from .models.layers.quantized import quantize_decoder
from .models.registry import build_decoder, language_config
from .quantization import SCALE, graph_form, layer_format, quantized_layers
from .weights import bind_weights

WEIGHTS_FILE = "model.safetensors"
GRAPHS_DIR = "graphs"
MANIFEST_FILE = "manifest.json"
_NOT_AN_ARTIFACT = (
    "{root} is not an optimum-neuronx artifact: {name} is missing. Export one with "
    "`optimum-cli export neuron --model <hf folder> ... <output dir>` and use the output dir."
)


# --- layout and manifest ----------------------------------------------------------------------


WINDOW_SPAN = "window_span"
"""The manifest key of a graph's compiled KV windows ``[lowest, highest]`` (graphs whose window is symbolic)."""


def graph_file(name: str, suffix: str) -> str:
    """Relative path of the graph called ``name`` (`GraphSpec.name`) inside an artifact."""
    return f"{GRAPHS_DIR}/{name}{suffix}"


def sha256_of(path: Path) -> str:
    """Hex digest of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weight_signature(weights: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    """Name -> [shape, dtype] of every tensor of a weight set."""
    return {name: [list(t.shape), str(t.dtype)] for name, t in sorted(weights.items())}


def write_manifest(
    root: Path,
    files: dict[str, str],
    weights: dict[str, torch.Tensor],
    keys: dict[str, str],
    spans: dict[str, tuple[int, int]],
) -> None:
    """Record each graph file's hash, its key in the per-graph compile cache and, for a graph whose KV window is a
    symbolic dimension, the windows it was compiled for (``spans``, `graphs.compiled_form`), by graph name; and the
    weight signature the graphs were compiled against."""
    body = {
        "graphs": {
            name: {"file": f, "sha256": sha256_of(root / f), "cache_key": keys[name]}
            | ({WINDOW_SPAN: list(spans[name])} if name in spans else {})
            for name, f in files.items()
        },
        "weights": weight_signature(weights),
    }
    (root / GRAPHS_DIR / MANIFEST_FILE).write_text(json.dumps(body, indent=1))


def read_config(path: str | Path) -> NeuronConfig:
    """The checked `NeuronConfig` of the artifact at ``path``; `ArtifactError` when ``path`` is not an
    artifact of this toolkit and torch version (the one "is this an artifact" check)."""
    root = Path(path)
    if not (root / CONFIG_FILE).is_file():
        raise ArtifactError(_NOT_AN_ARTIFACT.format(root=root, name=CONFIG_FILE))
    return load_config_file((root / CONFIG_FILE).read_text())


HEADS_RECORD = "attention_heads"
"""The key under ``recorded`` in ``neuron_config.json`` of the attention heads the graphs compute (`head_record`)."""


def head_record(hf_config: Any, config: NeuronConfig) -> dict[str, Any]:
    """What the exporter records of the attention heads its graphs compute, over all tensor-parallel ranks: the
    model's heads padded with zero heads where they do not split (`layers.parallel.HeadLayout`; SmolLM2's 9 / 3 are
    12 / 4 at 2 ranks). vLLM is told them at serve time (`served_heads`)."""
    layout = head_layout(language_config(hf_config), config.tp_degree)
    return {HEADS_RECORD: {"heads": layout.padded_heads, "kv_heads": layout.padded_kv_heads}}


def served_heads(config: NeuronConfig) -> tuple[int, int]:
    """``(query heads, KV heads)`` the artifact's graphs compute over all ranks, as its export recorded them
    (`head_record`); `ArtifactError` for an artifact exported without the record."""
    found = config.extra.get("recorded", {}).get(HEADS_RECORD)
    if not isinstance(found, dict) or not all(isinstance(found.get(k), int) for k in ("heads", "kv_heads")):
        raise ArtifactError(
            f"{CONFIG_FILE} does not record the attention heads its graphs compute ({HEADS_RECORD}): the artifact "
            "was exported by an earlier optimum-neuronx; re-export it (optimum-cli export neuron ...)."
        )
    return found["heads"], found["kv_heads"]


@dataclass(frozen=True)
class Artifact:
    """An exported model directory, opened and checked."""

    root: Path
    config: NeuronConfig
    manifest: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> Artifact:
        """Open ``path``; `ArtifactError` when anything is missing or does not match."""
        root = Path(path)
        config = read_config(root)
        for name in ("config.json", WEIGHTS_FILE, f"{GRAPHS_DIR}/{MANIFEST_FILE}"):
            if not (root / name).is_file():
                raise ArtifactError(_NOT_AN_ARTIFACT.format(root=root, name=name))
        manifest = _read_json(root / GRAPHS_DIR / MANIFEST_FILE)
        _check_manifest(root, manifest, [spec.name for spec in graph_specs(config)])
        return cls(root, config, manifest)

    def hf_config(self) -> Any:
        """The transformers config saved in the artifact."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.root)

    def window_span(self, name: str) -> tuple[int, int] | None:
        """The KV windows graph ``name`` was compiled for when its window is a symbolic dimension (the runtime may
        call it in any whole number of blocks between them: `graphs.exact_window`); None for a static window or an
        artifact exported before spans were recorded (its calls keep to its buckets)."""
        span = self.manifest["graphs"].get(name, {}).get(WINDOW_SPAN)
        if span is None:
            return None
        low, high = span
        return int(low), int(high)

    def graph_path(self, name: str) -> Path:
        """Path of the graph called ``name``, checked against its recorded hash."""
        entry = self.manifest["graphs"].get(name)
        if entry is None:
            raise ArtifactError(f"{self.root} has no {name} graph; it was exported with other flags.")
        path = self.root / entry["file"]
        if not path.is_file():
            raise ArtifactError(f"graph file {path} is missing; re-export the model.")
        if sha256_of(path) != entry["sha256"]:
            raise ArtifactError(f"graph file {path} does not match its recorded hash (corrupt); re-export the model.")
        return path

    def load_weights(self, hf_config: Any, device: str | torch.device, rank: int = 0) -> dict[str, torch.Tensor]:
        """The weight set the graphs bind (`graph_weights` of the model ``hf_config``, this artifact's `hf_config`:
        rank ``rank``'s slice, packed when the artifact packs its linear layers, derived on the CPU), on ``device``; the
        stored set is checked against the signature the graphs were compiled with first."""
        path = self.root / WEIGHTS_FILE
        try:
            weights = load_file(str(path))
        except Exception as err:  # safetensors raises its own error types on a bad file
            raise ArtifactError(f"cannot read weights {path} ({err}); re-export the model.") from err
        if weight_signature(weights) != self.manifest.get("weights"):
            raise ArtifactError(
                f"{path} does not match the weights the graphs were compiled with (names, shapes or dtypes "
                "differ); re-export the model."
            )
        graph = graph_weights(hf_config, self.config, weights, rank)  # on the CPU: no XLA graph of its own
        return {name: tensor.to(device) for name, tensor in graph.items()}


def _check_manifest(root: Path, manifest: Any, expected: list[str]) -> None:
    """`ArtifactError` unless ``manifest`` has a file and hash for exactly the ``expected`` graphs."""
    if not _well_formed(manifest):
        raise ArtifactError(f"{root}/{GRAPHS_DIR}/{MANIFEST_FILE} is malformed; re-export the model.")
    graphs = sorted(manifest["graphs"])
    if graphs != sorted(expected):
        raise ArtifactError(
            f"{root}: manifest lists graphs {graphs}, the config needs {sorted(expected)}; re-export the model."
        )


def _well_formed(manifest: Any) -> bool:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("weights"), dict):
        return False
    graphs = manifest.get("graphs")
    return isinstance(graphs, dict) and all(
        isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("sha256"), str)
        for e in graphs.values()
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ArtifactError(f"cannot read {path} ({err}); re-export the model.") from err


# --- assembly: what the graphs run on ---------------------------------------------------------


def empty_decoder(hf_config: Any, config: NeuronConfig) -> StaticDecoder:
    """The static decoder of ``hf_config`` under ``config`` on the meta device, in the checkpoint's layout: names and
    shapes, no memory (one tensor-parallel rank's when ``config.tp_degree > 1``)."""
    with torch.device("meta"):
        return build_decoder(hf_config, config.sequence_length, config.max_topk, config.tp_degree)


def graph_decoder(hf_config: Any, config: NeuronConfig) -> StaticDecoder:
    """`empty_decoder` as the graphs compute it: its decoder layers' linear layers quantized when
    ``config.weight_format`` says so, the other linear layers packed when ``config.packed_linears``, attending with the
    CPU attention kernels when ``config.paged_attention``, sampling's candidates from the CPU kernel when
    ``config.cpu_kernels``."""
    decoder = empty_decoder(hf_config, config)
    quantize_decoder(decoder, config)
    if config.packed_linears:
        pack_decoder(decoder)
    add_lora(decoder, config)
    decoder.paged_attention = config.paged_attention
    decoder.cpu_candidates = config.cpu_kernels
    return decoder


def rank_weights(
    hf_config: Any, config: NeuronConfig, weights: dict[str, torch.Tensor], rank: int
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``rank``'s slice of the full weight set (the set itself at ``tp_degree == 1``, where
    ``hf_config`` is not read): the artifact stores the weights once, each rank slices its part when it loads them."""
    if not 0 <= rank < config.tp_degree:
        raise ArtifactError(f"rank {rank} does not exist in an artifact of tp_degree={config.tp_degree}.")
    return weights if config.tp_degree == 1 else shard_weights(weights, hf_config, config.tp_degree, rank)


def _check_packed_device(weights: dict[str, torch.Tensor]) -> None:
    """`IncompatibleConfigError` when the weights a packed decoder binds are not on the CPU: the kernel has no
    other implementation (on an XLA device every call would fall back to the host)."""
    devices = sorted({t.device.type for t in weights.values()} - {"cpu"})
    if devices:
        raise IncompatibleConfigError(
            f"the packed linear kernel runs on the CPU only, these weights are on {', '.join(devices)}: "
            "use linear_kernel='aten' (--linear_kernel aten) for this placement."
        )


def graph_weights(
    hf_config: Any, config: NeuronConfig, weights: dict[str, torch.Tensor], rank: int = 0
) -> dict[str, torch.Tensor]:
    """The weight set every graph of rank ``rank`` binds, derived from the stored ``weights`` (the checkpoint's layout,
    quantized layers in `quantization`'s stored form): the rank's slice (`quantization.graph_form`), its linear layers
    packed when ``config.packed_linears`` (together in one arena on huge pages where the OS offers them:
    `kernels.huge_pages`). The toolkit's kernel library is loaded when the graphs call one of its operators
    (`NeuronConfig.cpu_kernels`). Still one set: each packed tensor replaces its stored one, nothing is kept twice."""
    weights = graph_form(weights, config, lambda full: rank_weights(hf_config, config, full, rank))
    if config.packed_linears:
        _check_packed_device(weights)
    if config.cpu_kernels:
        kernel_library.load()
    adapters = lora_weights(graph_decoder(hf_config, config)) if config.max_loras else {}
    if not config.packed_linears:
        return weights | adapters
    names = packed_weights(graph_decoder(hf_config, config))
    packed = {name: packed_kernel.pack(tensor) for name, tensor in weights.items() if name in names}
    for layer in quantized_layers(weights):
        packed.update(_packed_quantized(layer, weights, layer_format(config, layer)))
    return weights | on_huge_pages(packed) | adapters


def _packed_quantized(layer: str, weights: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """A quantized layer's weight and scales in the packed kernel's layout (from `quantization.graph_form`'s)."""
    q, scale = weights[f"{layer}.weight"], weights[f"{layer}.{SCALE}"]
    panels = packed_kernel.pack_int8(q) if fmt == "int8" else packed_kernel.pack_int4(q)
    return {f"{layer}.weight": panels, f"{layer}.{SCALE}": packed_kernel.pack_scales(scale)}


def assemble(hf_config: Any, config: NeuronConfig, weights: dict[str, torch.Tensor]) -> StaticDecoder:
    """The graphs' decoder (`graph_decoder`) bound to ``weights`` (`graph_weights`: the tensors themselves, no copy),
    in eval mode."""
    decoder = graph_decoder(hf_config, config)
    bind_weights(decoder, weights)
    return decoder.eval()


def allocate_cache(hf_config: Any, config: NeuronConfig, device: str | torch.device) -> list[torch.Tensor]:
    """The one KV cache of an artifact: K and V per layer, ``[kv_blocks, kv_heads, block_size, head_dim]`` (the pool
    and the scratch block; of the language decoder, for an image-text model; a tensor-parallel rank's: its KV heads
    only); with ``--kv_cache_dtype int8``, int8 K and V and their float32 scales ``[kv_blocks, kv_heads,
    block_size]``."""
    hf_config = language_config(hf_config)
    if config.tp_degree > 1:
        hf_config = rank_config(hf_config, config.tp_degree)
    dims = attention_dims(hf_config)
    layers, block = hf_config.num_hidden_layers, config.block_size
    dtype, blocks = config.torch_dtype, config.kv_blocks
    return allocate_kv_cache(layers, blocks, dims.kv_heads, block, dims.head_dim, dtype, device, config.kv_int8)
