"""The per-graph compile cache and parallel compilation (docs/export.md, "The compile cache").

Every test exports into its own empty cache (``private_cache``: the packed kernel's build shared), so "compiled" and
"cached" are this test's own; the tiny llama is made before the cache is switched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from optimum.exporters.neuron import compile as compile_module
from optimum.exporters.neuron.compile import WORKERS_ENV, worker_count
from optimum.exporters.neuron.export import export
from optimum.exporters.neuron.graph_cache import ENTRY_FILE, graph_key
from optimum.neuron import NeuronModelForCausalLM
from optimum.neuron.backends import get_backend
from optimum.neuron.backends import inductor as inductor_backend
from optimum.neuron.cache_dir import cache_root
from optimum.neuron.config import NeuronConfig
from optimum.neuron.errors import ExportError
from optimum.neuron.graphs import graph_fields, graph_specs
from optimum.neuron.kernels import library
from tests.fixtures.llm.models import FIXTURE_BLOCK_SIZE, FIXTURE_KV_BUCKETS, export_fixture, tiny_model
from tests.fixtures.llm.reference import hf_greedy

PROMPT = [5, 17, 42, 9, 33, 71, 2, 64, 12, 90, 7, 41, 28, 3, 55, 19, 80, 11, 6, 25]
"""20 tokens: three chunks of 8, two of 16."""


def config(**changes: object) -> NeuronConfig:
    """The tiny export shape of the test fixtures (inductor, the minimal artifact: two graphs)."""
    base = {"batch_size": 2, "sequence_length": 32, "prefill_chunk_size": 8, "kv_buckets": FIXTURE_KV_BUCKETS}
    base["kv_block_size"] = FIXTURE_BLOCK_SIZE
    base["decode_logits"] = False
    return NeuronConfig(**{**base, **changes})  # type: ignore[arg-type]


@pytest.fixture
def model() -> Path:
    return tiny_model("llama")


@pytest.fixture
def private_cache(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache for this test (the packed kernel's build linked from the project cache)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    kernels = cache_root() / "kernels"
    kernels.mkdir(exist_ok=True)  # on a fresh clone the kernel is built on first use, through the link
    (cache / "kernels").symlink_to(kernels)
    monkeypatch.setenv("OPTIMUM_NEURON_CACHE", str(cache))
    monkeypatch.setenv("COLUMNS", "200")  # the progress lines whole
    return cache


def entries(cache: Path) -> list[Path]:
    """The finished graph entries of ``cache``."""
    return sorted(p for p in (cache / "graphs").iterdir() if (p / ENTRY_FILE).is_file())


def manifest_keys(artifact: Path) -> dict[str, str]:
    graphs = json.loads((artifact / "graphs" / "manifest.json").read_text())["graphs"]
    return {name: entry["cache_key"] for name, entry in graphs.items()}


def greedy(artifact: Path, new: int = 6) -> list[int]:
    model = NeuronModelForCausalLM.from_pretrained(artifact)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=new, do_sample=False, eos_token_id=[])
    return out[0, len(PROMPT) :].tolist()


def test_graph_fields_leave_out_what_the_spec_carries() -> None:
    assert graph_fields(config()) == graph_fields(config(prefill_chunk_size=16, decode_logits=True))
    assert graph_fields(config()) == graph_fields(config(speculation_length=3)), "a verification graph more, no other"
    assert graph_fields(config()) != graph_fields(config(batch_size=3))  # the cache rows every graph writes
    assert "prefill_chunk_size" not in graph_fields(config()) and "batch_size" in graph_fields(config())


def test_only_the_graphs_a_change_reaches_get_new_keys(model: Path) -> None:
    from optimum.exporters.neuron.compile import hf_config_of

    hf_config, backend = hf_config_of(model), get_backend("inductor")

    def keys(neuron_config: NeuronConfig) -> dict[str, str]:
        return {s.name: graph_key(s, neuron_config, hf_config, backend) for s in graph_specs(neuron_config)}

    eight, sixteen, three = keys(config()), keys(config(prefill_chunk_size=16)), keys(config(batch_size=3))
    assert eight == sixteen, "a symbolic chunk dimension spans every length up to the sequence: one prefill graph"
    assert keys(config(kv_buckets="8")) == eight, "windows 8, 16, 32 or 16, 32: a symbolic window spans them all"
    static = keys(config(prefill_chunk_size=16, chunk_buckets="none"))
    assert static["token_generation"] == eight["token_generation"]
    assert static["chunked_prefill"] != eight["chunked_prefill"]
    assert not set(eight.values()) & set(three.values())


def _generated_code(artifact: Path) -> dict[str, list[str]]:
    """The C++ AOTInductor generated for each graph, without its comments (which name temporary paths)."""
    code = {}
    for package in sorted((artifact / "graphs").glob("*.pt2")):
        with zipfile.ZipFile(package) as archive:
            for name in archive.namelist():
                if name.endswith(".cpp"):
                    lines = archive.read(name).decode().splitlines()
                    kind = name.rsplit(".", 2)[-2]  # kernel / wrapper
                    code[f"{package.stem}:{kind}"] = [x for x in lines if x.strip() and not x.lstrip().startswith("//")]
    return code


def test_parallel_compile_then_a_reexport_with_another_chunk(
    private_cache: Path, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two graphs compiled by two processes give the artifact one process gives (the shared fixture of the same
    config: the same keys, generated code, weights and tokens); a re-export changing only the chunk then takes both
    graphs (the prefill graph's symbolic chunk spans every length) and only reads the checkpoint; one with a static
    chunk (``chunk_buckets="none"``) compiles only its prefill graph and takes the token-generation graph; the tokens
    of both equal transformers'."""
    monkeypatch.setenv(WORKERS_ENV, "2")
    parallel = export(model, tmp_path / "eight", config())
    assert sum("compiled in" in line for line in capfd.readouterr().err.splitlines()) == 2
    with monkeypatch.context() as project:  # the shared fixture of this config, compiled in one process
        project.setenv("OPTIMUM_NEURON_CACHE", str((private_cache / "kernels").resolve().parent))
        project.delenv(WORKERS_ENV)
        serial = export_fixture("llama-2x4x8-inductor")
    capfd.readouterr()  # the fixture's own progress lines (it loads the checkpoint when it is not built yet)
    assert manifest_keys(parallel) == manifest_keys(serial)
    assert (serial / "model.safetensors").read_bytes() == (parallel / "model.safetensors").read_bytes()
    code = _generated_code(parallel)
    assert len(code) == 4 and code == _generated_code(serial)  # kernel + wrapper of both graphs
    assert greedy(parallel) == greedy(serial) == hf_greedy(model, PROMPT, 6)

    released = []  # a worker starts before the graphs are looked up; with none to compile it is stopped at once
    release = compile_module.WorkerProcess.release

    def recorded_release(worker: compile_module.WorkerProcess) -> None:
        released.append(worker._idle)
        release(worker)

    monkeypatch.setattr(compile_module.WorkerProcess, "release", recorded_release)
    sixteen = export(model, tmp_path / "sixteen", config(prefill_chunk_size=16))
    assert released[0] is True, released
    assert not [c for c in _children(os.getpid()) if "compile_worker" in _command(c) and _running(c)]
    err = capfd.readouterr().err
    assert "read checkpoint" in err and "load checkpoint" not in err, "nothing to trace: no decoder is built"
    shown = [line for line in err.splitlines() if "KV windows" in line]
    assert any("token_generation" in line and "(cached)" in line for line in shown), shown
    assert any("chunked_prefill [1, 4..16]" in line and "(cached)" in line for line in shown), shown
    assert manifest_keys(parallel) == manifest_keys(sixteen) and len(entries(private_cache)) == 2
    assert greedy(sixteen) == hf_greedy(model, PROMPT, 6)

    static = export(model, tmp_path / "static", config(prefill_chunk_size=16, chunk_buckets="none"))
    shown = [line for line in capfd.readouterr().err.splitlines() if "KV windows" in line]
    assert any("token_generation" in line and "(cached)" in line for line in shown), shown
    assert any("chunked_prefill [1, 16]" in line and "compiled in" in line for line in shown), shown
    one, two = manifest_keys(parallel), manifest_keys(static)
    assert one["token_generation"] == two["token_generation"] and one["chunked_prefill"] != two["chunked_prefill"]
    assert len(entries(private_cache)) == 3
    assert greedy(static) == hf_greedy(model, PROMPT, 6)


def test_rope_angles_are_computed_once_per_call() -> None:
    """Rope's cos and sin are computed once per graph call into a buffer, by one kernel, not again in each layer's
    rotation of the queries and of the keys (`backends.inductor._angles_computed_once`; without it the fixture's two
    layers' kernels each computed them). Inductor writes a vectorized ``.cos()`` or a scalar ``std::cos`` depending
    on the CPU's vector width (on AVX-512 the tiny fixture's angles do not fill a vector), so both count."""
    code = _generated_code(export_fixture("llama-2x4x8-inductor"))
    for graph in ("chunked_prefill", "token_generation"):
        kernels = "\n".join(code[f"{graph}:kernel"]).split('extern "C"')
        for function in ("cos", "sin"):
            computing = [k for k in kernels if f".{function}()" in k or f"std::{function}(" in k]
            assert len(computing) == 1, (graph, function, len(computing))


def test_the_reuse_rule_is_inductors_own_again_after_a_compile() -> None:
    """`_angles_computed_once` changes inductor's rule for the compile it wraps only, even one that fails."""
    from torch._inductor import ir

    own = ir.StorageBox.should_realize_on_reuse
    with pytest.raises(RuntimeError, match="compile failed"), inductor_backend._angles_computed_once():
        assert ir.StorageBox.should_realize_on_reuse is not own
        raise RuntimeError("compile failed")
    assert ir.StorageBox.should_realize_on_reuse is own


_EXPORT = """
import sys
from optimum.exporters.neuron.export import export
from tests.export.test_graph_cache import config
export(sys.argv[1], sys.argv[2], config(prompt_logprobs=sys.argv[3] == "1"))
"""


def _start_export(model: Path, out: Path, logprobs: bool, workers: int = 0) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", _EXPORT, str(model), str(out), "1" if logprobs else "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if workers:
        env[WORKERS_ENV] = str(workers)
    return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_two_exports_at_once_compile_each_shared_graph_once(private_cache: Path, model: Path, tmp_path: Path) -> None:
    """Two exports into one cache at the same time, sharing two graphs (the second adds the prompt-logprobs graph):
    both finish, every graph is compiled once, nothing half-written is left."""
    runs = [_start_export(model, tmp_path / name, name == "logprobs") for name in ("plain", "logprobs")]
    logs = [run.communicate(timeout=600)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    compiled = [line for log in logs for line in log.splitlines() if "compiled in" in line]
    assert len(compiled) == 3, compiled  # prefill, token generation, the all-rows prefill: once each
    assert len(entries(private_cache)) == 3
    assert not list((private_cache / "graphs").glob("*.tmp*"))
    plain, logprobs = manifest_keys(tmp_path / "plain"), manifest_keys(tmp_path / "logprobs")
    assert plain.items() <= logprobs.items()
    assert greedy(tmp_path / "logprobs") == hf_greedy(model, PROMPT, 6)


def test_a_killed_export_leaves_nothing_a_later_export_takes(private_cache: Path, model: Path, tmp_path: Path) -> None:
    run = _start_export(model, tmp_path / "killed", False)
    deadline = time.monotonic() + 300
    while not list((private_cache / "graphs").glob("*.tmp*")) and time.monotonic() < deadline:
        assert run.poll() is None, run.communicate()[1][-2000:]
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)  # mid-compile
    run.wait()
    assert not entries(private_cache), "a graph the killed export was compiling became an entry"
    assert list((private_cache / "graphs").glob("*.tmp*")), "the killed export's staging folder is gone"
    artifact = export(model, tmp_path / "again", config())
    assert len(entries(private_cache)) == 2
    assert greedy(artifact) == hf_greedy(model, PROMPT, 6)


def test_a_worker_dies_with_its_exporter(private_cache: Path, model: Path, tmp_path: Path) -> None:
    """The exporter alone killed (not its process group) mid-compile: its worker process dies with it (Linux's
    parent-death signal) instead of finishing a graph for nobody. What tells the two apart is the worker's staging
    folder, not a clock (a loaded machine can take seconds to tear a killed process down): a worker that outlived
    its exporter writes its graph there, then fails to answer and exits; a killed one leaves it without a graph."""
    library.load()  # built first: the worker killed is compiling a graph, not building the kernel library
    run = _start_export(model, tmp_path / "killed", False, workers=2)
    deadline = time.monotonic() + 300
    # the graphs' staging folders are made once the export knows its jobs; a worker runs the C++ compiler before that
    # too (inductor's check of the vector ISAs, on a fresh cache), so both are waited for
    while not (staged := list((private_cache / "graphs").glob(f"*.tmp{run.pid}"))) or not (
        workers := _compiling_workers(run.pid)
    ):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-2000:]
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 120  # the worker's graph, had it gone on, would be written well before
    while (alive := [pid for pid in workers if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, f"worker processes {alive} outlived their exporter: {[_command(pid) for pid in alive]}"
    finished = [graph for folder in staged for graph in folder.glob("*.pt2")]
    assert not finished, f"a worker finished {finished} after its exporter was killed"


def _compiling_workers(pid: int) -> list[int]:
    """The compile workers of exporting process ``pid`` that are running the C++ compiler (a child of theirs other
    than ninja, which checks the kernel library on every load, and than a Python interpreter: inductor loads each
    vector ISA's test library in one when it picks the ISA, in every new process)."""
    workers = [child for child in _children(pid) if "exporters.neuron.compile_worker" in _command(child)]
    compilers = {w: [_command(c) for c in _children(w)] for w in workers}
    return [w for w, commands in compilers.items() if any(c and not _tool(c) for c in commands)]


def _tool(command: str) -> bool:
    """Whether a worker's child running ``command`` is ninja or a Python interpreter, not the C++ compiler."""
    program = Path(command.split(" ", 1)[0]).name
    return program.startswith(("ninja", "python"))


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux's ``/proc``; a thread that ends while it is read has none)."""
    children = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children.extend(int(child) for child in path.read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return children


def _command(pid: int) -> str:
    """Process ``pid``'s command line (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or during the read (ESRCH)
        return ""


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_worker_count(model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert worker_count(3, config(), model) == 1  # a tiny checkpoint compiles in the exporting process
    assert worker_count(3, config(backend="eager"), model) == 1
    big = tmp_path / "big"
    big.mkdir()
    with (big / "model.safetensors").open("wb") as handle:
        handle.truncate(200 << 20)  # a sparse 200 MB checkpoint: only its size is read
    monkeypatch.setattr(compile_module, "_available_memory", lambda: 64 << 30)
    assert worker_count(3, config(), big) == min(3, len(os.sched_getaffinity(0)))
    assert worker_count(1, config(), big) == 1
    monkeypatch.setattr(compile_module, "_available_memory", lambda: 1 << 30)  # not even one process's share
    assert worker_count(3, config(), big) == 1
    monkeypatch.setenv(WORKERS_ENV, "2")
    assert worker_count(3, config(), model) == 2
    monkeypatch.setenv(WORKERS_ENV, "two")
    with pytest.raises(ExportError, match=WORKERS_ENV):
        worker_count(3, config(), model)


def test_the_graph_cache_switched_off(
    private_cache: Path, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``OPTIMUM_NEURON_GRAPH_CACHE=off`` (how the suite is timed without the per-graph cache, docs/testing.md): the
    export compiles its graphs into the artifact and stores none; the artifact cache still serves it; a value other
    than on / off is refused before anything is built (eager: nothing to compile)."""
    monkeypatch.setenv("OPTIMUM_NEURON_GRAPH_CACHE", "off")
    artifact = export(model, tmp_path / "off", config(backend="eager"))
    assert not (private_cache / "graphs").exists() or not entries(private_cache)
    assert greedy(artifact) == hf_greedy(model, PROMPT, 6)
    monkeypatch.setenv("OPTIMUM_NEURON_GRAPH_CACHE", "no")
    with pytest.raises(ExportError, match="OPTIMUM_NEURON_GRAPH_CACHE='no': use on"):
        export(model, tmp_path / "refused", config(backend="eager", prefill_chunk_size=16))
    assert not (tmp_path / "refused").exists()
    monkeypatch.setenv("OPTIMUM_NEURON_GRAPH_CACHE", "on")
    export(model, tmp_path / "on", config(backend="eager", prefill_chunk_size=16))
    assert len(entries(private_cache)) == 2
