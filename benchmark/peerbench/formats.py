"""What each system's weights are, exactly, in a run of each ``--weight-format``, and what its model file holds:
the bytes of its weight tensors by stored type, read from the file itself (a safetensors header, an OpenVINO IR's
constants, a GGUF's tensor table), and the bytes a decode step of ours reads, the numerator of the bandwidth floor.

Everything here reads headers only (no weights are loaded), with the standard library, so that it runs in the
orchestrator and in the tests without the peers installed; the GGUF table is read with ``gguf-py`` from the
llama.cpp tree that `install` unpacked.
"""

from __future__ import annotations

import json
import struct
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmark.peerbench.layout import GGUF_TYPES, GROUP_SIZE, Layout

EMBEDDING, LM_HEAD = "embed_tokens.weight", "lm_head.weight"
"""How our artifact names the token embedding table and the LM head (any prefix)."""

OURS_FORMATS = {
    "fp32": {"weight_format": "float", "weight_group_size": 0, "lm_head_format": "float"},
    "int8": {"weight_format": "int8", "weight_group_size": 0, "lm_head_format": "int8"},
    "int4": {"weight_format": "int4", "weight_group_size": GROUP_SIZE, "lm_head_format": "int8"},
}
"""Our export's ``NeuronConfig`` fields for each format (``--weight_format``, ``--weight_group_size``,
``--lm_head_format``): the quantized runs quantize the tied embedding / LM head table to int8, as both peers do."""

DESCRIPTIONS: dict[str, dict[str, str]] = {
    "fp32": {
        "ours": "fp32 everywhere (`--weight_format float`)",
        "openvino": "fp32 IR (`--weight-format fp32`); fp32 inference (`INFERENCE_PRECISION_HINT=f32`)",
        "llamacpp": "F32 GGUF (`convert_hf_to_gguf.py --outtype f32`)",
    },
    "int8": {
        "ours": "`--weight_format int8 --lm_head_format int8`: the decoder layers' linear weights and the token "
        "embedding / tied LM head table int8, symmetric, one fp32 scale per output channel (vocabulary row for the "
        "table; `q = round(w / (max(abs(w_row)) / 127))`); norms fp32; the packed kernel dequantizes in registers "
        "and multiplies fp32 activations in fp32",
        "openvino": "`optimum-cli export openvino --weight-format int8` (optimum-intel's default, NNCF `INT8_ASYM`): "
        "every weight matrix, the token embedding / tied LM head included, u8 per output channel, asymmetric (a u8 "
        "zero point and an f16 scale per channel; NNCF's log: `int8_asym, per-channel` for 211 of 212 weights, 100 % "
        "of the parameters); norms fp32; activations f32 between layers, quantized to int8 per group of 32 inside "
        "the compressed layers by the CPU plugin's default dynamic quantization (see below)",
        "llamacpp": "`llama-quantize ... Q8_0`: every weight matrix, `token_embd` (the tied output) included, in "
        "blocks of 32 int8 values with one fp16 scale (symmetric, 8.5 bits per weight); norms F32; the CPU backend "
        "quantizes the activations to Q8_0 blocks on the fly and multiplies in int8 dot products",
    },
    "int4": {
        "ours": f"`--weight_format int4 --weight_group_size {GROUP_SIZE} --lm_head_format int8`: the decoder layers' "
        f"linear weights int4, symmetric, one fp32 scale per group of {GROUP_SIZE} input columns "
        "(`q = round(w / (max(abs(w_group)) / 7))` in [-7, 7], two per byte); the token embedding / tied LM head "
        "table int8, one fp32 scale per vocabulary row; norms fp32; the packed kernel dequantizes in registers and "
        "multiplies fp32 activations in fp32",
        "openvino": f"`optimum-cli export openvino --weight-format int4 --group-size {GROUP_SIZE}` (optimum-intel's "
        f"defaults otherwise: NNCF `INT4_ASYM`, ratio 1.0): the decoder layers' weights u4, asymmetric, groups of "
        f"{GROUP_SIZE} input columns (a u4 zero point and an f16 scale per group); the token embedding / tied LM head "
        "in NNCF's backup precision, u8 per channel, asymmetric (its log: `int4_asym, group size 64` for 210 weights, "
        "79 % of the parameters, `int8_asym, per-channel` for 1, 21 %); norms fp32; activations f32 between layers, "
        "quantized to int8 per group of 32 inside the compressed layers by the CPU plugin's default dynamic "
        "quantization (see below)",
        "llamacpp": "`llama-quantize ... Q4_0`: the decoder layers' weights in blocks of 32 4-bit values with one "
        "fp16 scale (symmetric around 8, 4.5 bits per weight); `token_embd` (the tied output) kept in Q8_0 "
        "(llama-quantize gives the output tensor Q6_K, whose 256-blocks do not divide SmolLM2's 576 columns: its log "
        "says `falling back to q8_0`); norms F32; activations quantized to Q8_0 blocks on the fly (int8 dot "
        "products), Q4_0 repacked at load into 8-row interleaved blocks on AVX2 CPUs (`CPU_REPACK`)",
    },
}
"""Each system's weight format, exactly (checked against optimum-intel 2.2's CLI defaults and NNCF's log of the
export, llama.cpp b11434's ``llama-quantize`` source and log, and `optimum.neuron.quantization`)."""


def safetensors_tensors(path: Path) -> dict[str, tuple[str, int]]:
    """``{name: (dtype, bytes)}`` of every tensor a safetensors file stores, from its header alone."""
    with path.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    return {
        name: (entry["dtype"], entry["data_offsets"][1] - entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def by_type(tensors: Mapping[str, tuple[str, int]]) -> dict[str, int]:
    """Bytes per stored type, largest first."""
    out: dict[str, int] = {}
    for dtype, size in tensors.values():
        out[dtype] = out.get(dtype, 0) + size
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def decode_bytes(tensors: Mapping[str, tuple[str, int]]) -> dict[str, Any]:
    """The bytes a decode step reads from weights: every stored tensor (each read once a step: the linear
    layers' quantized values and scales, the norms, the LM head) but the token embedding table when a separate LM
    head is stored (the step then gathers one row of it); with tied embeddings the table is stored once and the LM
    head reads all of it. The KV cache is counted apart (`figures.kv_bytes`), activations not at all."""
    stored = sum(size for _, size in tensors.values())
    embedding = sum(size for name, (_, size) in tensors.items() if name.endswith(EMBEDDING))
    tied = not any(name.endswith(LM_HEAD) for name in tensors)
    return {"stored": stored, "embedding": embedding, "tied": tied, "decode": stored if tied else stored - embedding}


def config_decode_bytes(shape: Mapping[str, int], weight_format: str, lm_head_format: str = "float") -> int:
    """`decode_bytes` from the model's shape (`probes.model_shape`) under our scheme, for a run that has not
    exported our artifact: fp32 for everything but the decoder layers' linear weights, which take 1 byte (int8) or
    half a byte (int4) each plus one fp32 scale per output row (int8) or per `GROUP_SIZE` weights (int4), and the LM
    head under ``lm_head_format`` int8 (1 byte a weight, one fp32 scale per vocabulary row); a tied embedding counted
    once, an untied one not at all (one row gathered)."""
    floats = shape["params"] - shape["linear_params"]
    if not shape.get("tied", True):
        floats -= shape["lm_head_params"]  # the embedding table: the step gathers one row of it
    linear = shape["linear_params"]
    if weight_format == "int8":
        quantized = linear + 4 * shape["linear_rows"]
    elif weight_format == "int4":
        quantized = linear // 2 + 4 * (linear // GROUP_SIZE)
    else:
        quantized = 4 * linear
    if lm_head_format == "int8":
        floats -= shape["lm_head_params"]
        quantized += shape["lm_head_params"] + 4 * shape["vocab"]
    return 4 * floats + quantized


def openvino_constants(xml: Path) -> dict[str, int]:
    """Bytes per element type of an OpenVINO IR's constants (its ``.bin``'s content), from the ``.xml``."""
    out: dict[str, int] = {}
    seen = set()
    for layer in ElementTree.parse(xml).getroot().iter("layer"):
        data = layer.find("data")
        if layer.get("type") == "Const" and data is not None:
            where = (data.get("offset"), data.get("size"))
            if where in seen:  # constants that share their bytes in the .bin are counted once
                continue
            seen.add(where)
            kind = data.get("element_type", "?")
            out[kind] = out.get(kind, 0) + int(data.get("size", 0))
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def gguf_tensors(path: Path, gguf_py: Path) -> dict[str, tuple[str, int]]:
    """``{name: (type, bytes)}`` of a GGUF's tensors, read with the llama.cpp tree's ``gguf-py``."""
    sys.path.insert(0, str(gguf_py))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(str(gguf_py))
    return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(str(path)).tensors}


def _file(path: Path, weights: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {"file": str(path), "weights": weights, "weight_bytes": sum(weights.values())} | extra


def describe(layout: Layout, systems: list[str], artifact: str | None) -> dict[str, dict[str, Any]]:
    """Each system's format (`DESCRIPTIONS`), model file and weight bytes by type; for ours (``artifact``, our
    batch-1 artifact) also the group size the export recorded and `decode_bytes`. A file that cannot be read is
    recorded as an error, never fatal."""
    fmt = layout.weight_format
    out: dict[str, dict[str, Any]] = {}
    for system in systems:
        entry: dict[str, Any] = {"format": DESCRIPTIONS[fmt][system]}
        try:
            if system == "ours" and artifact:
                tensors = safetensors_tensors(Path(artifact) / "model.safetensors")
                config = json.loads((Path(artifact) / "neuron_config.json").read_text())
                recorded = {k: config.get(k) for k in ("weight_format", "weight_group_size", "linear_kernel")}
                counted = decode_bytes(tensors)
                entry |= _file(Path(artifact) / "model.safetensors", by_type(tensors), decode_bytes=counted)
                entry["config"] = recorded
            elif system == "openvino":
                xml = layout.openvino_ir / "openvino_model.xml"
                entry |= _file(xml.with_suffix(".bin"), openvino_constants(xml))
            elif system == "llamacpp":
                tensors = gguf_tensors(layout.gguf, layout.llama_source / "gguf-py")
                kept = {n: t for n, (t, _) in tensors.items() if n in ("token_embd.weight", "output.weight")}
                entry |= _file(layout.gguf, by_type(tensors), gguf_type=GGUF_TYPES[fmt], embedding_output=kept)
            if "file" in entry:
                entry["file_bytes"] = Path(entry["file"]).stat().st_size
        except (OSError, ValueError, KeyError, ImportError, ElementTree.ParseError) as err:
            entry["error"] = f"{type(err).__name__}: {err}"
        out[system] = entry
    return out
