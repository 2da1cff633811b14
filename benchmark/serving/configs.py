"""What the serving benchmark runs: the four artifact configurations and the workloads (full or quick)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServeConfig:
    """One exported artifact to serve: chunked prefill or context encoding, on-device sampling or not."""

    name: str
    label: str
    chunked: bool
    on_device_sampling: bool


CONFIGS = (
    ServeConfig("ce-ods", "context encoding + on-device sampling", chunked=False, on_device_sampling=True),
    ServeConfig("ce-cpu", "context encoding + CPU sampling", chunked=False, on_device_sampling=False),
    ServeConfig("chunked-cpu", "chunked prefill + CPU sampling", chunked=True, on_device_sampling=False),
    ServeConfig("chunked-hybrid", "chunked prefill + hybrid sampling", chunked=True, on_device_sampling=True),
)
MIXED_CONFIGS = ("ce-ods", "chunked-hybrid")
"""The mixed workload compares how long prompts disturb running decodes with and without chunks."""


@dataclass(frozen=True)
class Load:
    """One `vllm bench serve` run: ``prompts`` random prompts of ``input_len`` tokens and ``output_len`` new
    tokens each, both varied by +- ``range_ratio`` (one ratio: the load generator takes one), at most
    ``users`` in flight."""

    prompts: int
    users: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0


@dataclass(frozen=True)
class Workload:
    """Everything one benchmark run serves: the artifacts' shape and the loads driven against them."""

    sequence_length: int
    chunk: int
    batch_size: int
    main: Load
    chats: Load
    """Short chats: decoding while the long prompts of `arrivals` come in (mixed workload)."""
    arrivals: Load
    arrival_lead_s: float
    """The first long prompt arrives about this long after the chats start sending; the next ones follow at
    the same spacing, chat client start-up (measured in the idle run) + this lead."""


FULL = Workload(
    sequence_length=2048,
    chunk=256,
    batch_size=8,
    main=Load(prompts=16, users=8, input_len=1500, output_len=128, range_ratio=0.1),
    chats=Load(prompts=12, users=4, input_len=64, output_len=128),
    arrivals=Load(prompts=4, users=1, input_len=1500, output_len=4),
    arrival_lead_s=5.0,
)
QUICK = Workload(
    sequence_length=512,
    chunk=64,
    batch_size=8,
    main=Load(prompts=8, users=8, input_len=300, output_len=32, range_ratio=0.1),
    chats=Load(prompts=8, users=4, input_len=32, output_len=48),
    arrivals=Load(prompts=2, users=1, input_len=300, output_len=4),
    arrival_lead_s=1.0,
)


def export_config(
    model_dir: Path, config: ServeConfig, workload: Workload, dtype: str, backend: str, device: str
) -> Path:
    """The artifact for ``config`` (exported once, then reused through the export cache)."""
    from optimum.exporters.neuron.cache import cache_root
    from optimum.exporters.neuron.export import export
    from optimum.neuron.config import NeuronConfig

    neuron_config = NeuronConfig(
        batch_size=workload.batch_size,
        sequence_length=workload.sequence_length,
        prefill_chunk_size=workload.chunk if config.chunked else 0,
        on_device_sampling=config.on_device_sampling,
        auto_cast_type=dtype,
        backend=backend,
        device=device,
    )
    name = (
        f"{model_dir.name}-{config.name}-s{workload.sequence_length}-b{workload.batch_size}-{dtype}-{backend}-{device}"
    )
    return export(model_dir, cache_root() / "bench" / "serving" / name, neuron_config)
