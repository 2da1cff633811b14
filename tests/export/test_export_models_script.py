"""``tests/fixtures/llm/export_models.py``: listing, glob selection, a no-match error, one cached export."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.fixtures.llm.models import EXPORT_FIXTURES

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "export_models.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    """Run the script as ``make export-fixtures`` does (a plain ``python path/to/script``)."""
    cwd = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=dict(os.environ)
    )


def test_list_prints_every_fixture() -> None:
    done = run_script("--list")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == list(EXPORT_FIXTURES)


def test_list_with_globs_selects() -> None:
    done = run_script("--list", "llama-*-eager", "qwen3-2x1x32-ce-*")
    assert done.returncode == 0, done.stderr
    expected = [
        n
        for n in EXPORT_FIXTURES
        if (n.startswith("llama-") and n.endswith("-eager")) or n.startswith("qwen3-2x1x32-ce-")
    ]
    assert done.stdout.split() == expected
    # llama's chunked and CE eager fixtures: plain, -logprobs, -kv1-tp2; the padded -h6-kv3-tp2; the chunked -aten;
    # the quantized chunked -int8, -int4, -aten-int4, -h6-kv3-tp2-int8, -int8-headint8 and -int4-full; the paged
    # 2x8x16 and -pool32; the int8 KV cache's chunked, CE and -h6-kv3-tp2 -kvint8; the speculative -spec3 and
    # -h6-kv3-tp2-spec3; the multi-LoRA -lora2, -tp2-lora2 and -int8-lora2; GPTQ's -int4-gptq and -int4-full-gptq;
    # the mixed-batch -mixed and -kvint8-mixed; qwen3's CE two
    assert len(expected) == 30


def test_glob_matching_nothing_exits_2_listing_names() -> None:
    done = run_script("nope-*")
    assert done.returncode == 2
    assert "no export fixture matches nope-*" in done.stderr
    for name in EXPORT_FIXTURES:
        assert name in done.stderr
    assert done.stdout == ""


def test_exports_one_fixture_with_progress() -> None:
    done = run_script("llama-2x4x8-eager")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done   llama-2x4x8-eager" in done.stdout
    assert "1/1 fixtures exported" in done.stdout
    assert "artifact:" in done.stdout, "the export's own output should appear in the log window"
