"""Compiling the graphs of one export: what a graph is compiled from (`GraphBuilder`), and several graphs compiled at
once, this process and spawned workers taking them from one queue (`compile_graphs`), as many processes as cores and
free memory allow (`worker_count`).

Each process loads the checkpoint once and compiles whole graphs, one at a time, on one core: an AOTInductor compile
is single-threaded Python and one C++ compiler run, so inductor's own compile workers are turned off in every
process of a parallel export (each core already has its graph).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...neuron.artifact import allocate_cache, assemble, empty_decoder, graph_weights
from ...neuron.backends import get_backend
from ...neuron.backends.base import Backend
from ...neuron.config import NeuronConfig
from ...neuron.errors import ExportError, UnsupportedModelError
from ...neuron.graphs import GraphSpec, compiled_form, example_inputs, graph_args, image_row_inputs, symbolic_dims
from ...neuron.models.base import StaticDecoder, graph_module
from ...neuron.models.registry import language_config, served_config, supported_model_types
from ...neuron.prequantized import check_served_config, stored_weights
from ...neuron.quantization import fit_weight_format
from ...neuron.weights import read_checkpoint

WORKERS_ENV = "OPTIMUM_NEURON_COMPILE_WORKERS"
"""Environment variable fixing the number of processes that compile one export's graphs (1: all in the exporting
process); unset, `worker_count` decides."""
PARENT_ENV = "OPTIMUM_NEURON_COMPILE_PARENT"
"""Set by `WorkerProcess` for its worker: the exporting process's id (the worker exits with it, `compile_worker`)."""
PARALLEL_MIN_CHECKPOINT_BYTES = 64 << 20
"""Checkpoints smaller than this compile in the exporting process: a worker's start (torch imported, checkpoint
loaded: ~5 s) costs more than it saves on graphs that compile in seconds (a tiny test model's two graphs: 17.8 s in one
process, 21.1 s with a worker, on 2 cores)."""
PROCESS_MEMORY_BASE = 1 << 30
"""Bytes one compiling process needs besides its model's weights (torch, inductor, the traced program): with
`PROCESS_MEMORY_PER_WEIGHT_BYTE` an upper bound of the measured peaks (SmolLM2-135M fp32: 2.6 GB per process)."""
PROCESS_MEMORY_PER_WEIGHT_BYTE = 3
"""Bytes one compiling process holds per byte of checkpoint (the checkpoint read, the decoder's weights, their
packed layout)."""


def hf_config_of(model_dir: Path) -> Any:
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
    served = served_config(config)
    check_served_config(config, served)
    return served


def load_decoder(
    hf_config: Any, model_dir: Path, config: NeuronConfig, device: str | torch.device | None = None
) -> tuple[StaticDecoder, dict]:
    """The static decoder of ``model_dir`` with its strictly mapped weights, on ``device`` (default
    ``config.device``; the xla backend passes its XLA device, see `Backend.placement`), and the full weight set the
    artifact stores (on the CPU). The graphs' form of the weights (`graph_weights`: a rank's slice, quantized
    layers unpacked, packed panels) is derived on the CPU, then placed on ``device``: on an XLA device the
    derivation would be traced and compiled as one more graph. At ``tp_degree > 1`` the decoder is rank 0's, bound
    to its slice (every rank runs the same graph)."""
    config = fit_weight_format(config, hf_config)
    stored = artifact_weights(hf_config, model_dir, config)
    graph = {k: v.to(device or config.device) for k, v in graph_weights(hf_config, config, stored).items()}
    return assemble(hf_config, config, graph), stored


def artifact_weights(hf_config: Any, model_dir: Path, config: NeuronConfig) -> dict[str, torch.Tensor]:
    """The full weight set an artifact of ``model_dir`` under ``config`` stores (on the CPU): all an export needs
    when every graph comes from the cache."""
    config = fit_weight_format(config, hf_config)
    layout = empty_decoder(hf_config, config.derive(tp_degree=1))
    return stored_weights(layout, hf_config, read_checkpoint(model_dir), config)


@dataclass
class GraphBuilder:
    """What this process compiles graphs from: the decoder bound to its weights and the KV cache to trace against
    (``config`` is the export's, images fitted)."""

    hf_config: Any
    config: NeuronConfig
    decoder: StaticDecoder
    kv_cache: list[torch.Tensor]
    device: str | torch.device

    @classmethod
    def load(cls, model_dir: Path, config: NeuronConfig) -> tuple[GraphBuilder, dict[str, torch.Tensor]]:
        """The builder of ``model_dir``'s graphs under ``config``, and the weight set the artifact stores."""
        device = get_backend(config.backend).placement(config.device)
        hf_config = hf_config_of(model_dir)
        decoder, weights = load_decoder(hf_config, model_dir, config, device)
        return cls(hf_config, config, decoder, allocate_cache(hf_config, config, device), device), weights

    @property
    def backend(self) -> Backend:
        """The backend compiling the graphs."""
        return get_backend(self.config.backend)

    def compile(self, spec: GraphSpec, folder: Path) -> float:
        """Trace and compile graph ``spec`` (its `compiled_form`) into ``folder`` (`graph_file_name`); returns the
        seconds it took."""
        start = time.perf_counter()
        spec = compiled_form(spec)
        inputs = example_inputs(spec)
        if spec.images:
            hidden = language_config(self.hf_config).hidden_size
            inputs.update(image_row_inputs(spec, hidden, self.config.torch_dtype))
        args = graph_args(spec.kind, {k: v.to(self.device) for k, v in inputs.items()}, self.kv_cache)
        module = graph_module(self.decoder, spec).eval()
        self.backend.compile(module, args, folder / graph_file_name(spec, self.backend), symbolic_dims(spec))
        return time.perf_counter() - start


def graph_file_name(spec: GraphSpec, backend: Backend) -> str:
    """The file a backend writes graph ``spec`` to, in an artifact's graph folder or a cache entry."""
    return f"{spec.name}{backend.suffix}"


def worker_count(graphs: int, config: NeuronConfig, model_dir: Path) -> int:
    """How many processes compile ``graphs`` graphs of one export: `WORKERS_ENV` when set, else one per graph
    bounded by the usable cores and by the available memory (`PROCESS_MEMORY_BASE` plus
    `PROCESS_MEMORY_PER_WEIGHT_BYTE` per checkpoint byte each); 1 for a backend that compiles in-process and for a
    checkpoint under `PARALLEL_MIN_CHECKPOINT_BYTES`."""
    if graphs <= 1 or not get_backend(config.backend).compiles_in_workers:
        return 1
    fixed = os.environ.get(WORKERS_ENV, "").strip()
    if fixed:
        if not fixed.isdigit() or int(fixed) < 1:
            raise ExportError(f"{WORKERS_ENV}={fixed!r} is not a positive integer: set it to 1, 2, ... or unset it.")
        return min(graphs, int(fixed))
    checkpoint = sum(p.stat().st_size for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    if checkpoint < PARALLEL_MIN_CHECKPOINT_BYTES:
        return 1
    per_process = PROCESS_MEMORY_BASE + PROCESS_MEMORY_PER_WEIGHT_BYTE * checkpoint
    return max(1, min(graphs, len(os.sched_getaffinity(0)), _available_memory() // per_process))


def _available_memory() -> int:
    """The kernel's estimate of memory available to new work (``MemAvailable``), 0 when unknown (one process)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


Job = tuple[GraphSpec, Path]
"""A graph to compile and the folder to write it into."""
Done = Callable[[GraphSpec, float], None]
"""Called (from any thread) when a graph is compiled, with its compile seconds."""


def start_workers(count: int, model_dir: Path, config: NeuronConfig, stack: ExitStack) -> list[WorkerProcess]:
    """``count - 1`` worker processes for an export whose graphs ``count`` processes compile (`worker_count`),
    started before the export knows which graphs it must compile (their imports overlap its cache lookups); each
    leaves with ``stack``."""
    return [stack.enter_context(WorkerProcess(model_dir, config)) for _ in range(count - 1)]


def helpers_for(jobs: list[Job], workers: list[WorkerProcess]) -> list[WorkerProcess]:
    """The workers that help compile ``jobs``: one per job beyond this process's first; the others are released now."""
    helping = workers[: max(0, len(jobs) - 1)]
    for idle in workers[len(helping) :]:
        idle.release()
    return helping


def compile_graphs(jobs: list[Job], load: Callable[[], GraphBuilder], workers: list[WorkerProcess], done: Done) -> None:
    """Compile every job: this process (its builder made by ``load``) takes jobs from the front of one queue, the
    ``workers`` (`helpers_for`) from its back. ``done`` is called per compiled graph; the first failure empties the
    queue and is raised once the running compiles are over."""
    queue = _JobQueue(jobs)
    if not workers:
        queue.drain(load, done)
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        feeders = [threading.Thread(target=queue.feed, args=(p, done), daemon=True) for p in workers]
        for thread in feeders:
            thread.start()
        try:
            queue.drain(load, done)
        finally:
            for thread in feeders:
                thread.join()
    queue.raise_failure()


class _JobQueue:
    """The jobs of one export, taken from the front by this process and from the back by the threads feeding
    worker processes; the first failure stops everyone."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = deque(jobs)
        self.lock = threading.Lock()
        self.failures: list[BaseException] = []

    def take(self, front: bool) -> Job | None:
        """The next job, None when there is none left or a compile failed."""
        with self.lock:
            if self.failures or not self.jobs:
                return None
            return self.jobs.popleft() if front else self.jobs.pop()

    def drain(self, load: Callable[[], GraphBuilder], done: Done) -> None:
        """Load this process's builder, then compile jobs with it until none is left."""
        try:
            builder = load()
            while (job := self.take(True)) is not None:
                done(job[0], builder.compile(*job))
        except BaseException as err:
            self.fail(err)
            raise

    def feed(self, worker: WorkerProcess, done: Done) -> None:
        """Hand jobs to ``worker`` one at a time until none is left, then let it exit while the other processes
        still compile (a feeding thread's loop)."""
        while (job := self.take(False)) is not None:
            try:
                done(job[0], worker.compile(*job))
            except BaseException as err:  # raised by the exporting thread (`raise_failure`)
                self.fail(err)
        worker.release()

    def fail(self, err: BaseException) -> None:
        """Record a failure: no job starts after it."""
        with self.lock:
            self.failures.append(err)

    def raise_failure(self) -> None:
        """Raise the first failure of a worker, if any."""
        if self.failures:
            raise self.failures[0]


class WorkerProcess:
    """A process compiling graphs for this one (`compile_worker`): started with ``python -m`` (so it never imports
    the caller's script), it loads the checkpoint once and answers one pickled job at a time over its pipes."""

    def __init__(self, model_dir: Path, config: NeuronConfig) -> None:
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", PARENT_ENV: str(os.getpid())}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the code this process runs, not another copy
        command = [sys.executable, "-m", "optimum.exporters.neuron.compile_worker"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        # inductor generates CPU code for the thread count of the compiling process: the worker takes this one's
        self._send((model_dir, config, torch.get_num_threads()))
        self._idle = True  # no job sent yet

    def __enter__(self) -> WorkerProcess:
        return self

    def release(self) -> None:
        """Close the job pipe: the worker exits once its current graph is answered; one never given a job is stopped
        at once (it imports or loads the checkpoint: nothing to finish)."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        if self._idle:
            self.process.kill()

    def __exit__(self, *exc: object) -> None:
        """Close the job pipe (the worker exits); kill it when the export failed or it does not exit."""
        self.release()
        try:
            self.process.wait(timeout=None if exc[0] is None else 0.1)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def compile(self, spec: GraphSpec, folder: Path) -> float:
        """`GraphBuilder.compile` in the worker; its error raised here."""
        self._idle = False
        self._send((spec, folder))
        assert self.process.stdout is not None
        try:
            ok, value = pickle.load(self.process.stdout)
        except EOFError:
            raise ExportError(
                f"the worker process compiling {spec.name} died (exit status {self.process.wait()}: killed, or out "
                f"of memory?): export again with {WORKERS_ENV}=1 to compile in the exporting process."
            ) from None
        if not ok:
            raise value
        return float(value)

    def _send(self, message: object) -> None:
        assert self.process.stdin is not None
        pickle.dump(message, self.process.stdin)
        self.process.stdin.flush()
