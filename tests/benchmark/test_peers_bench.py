"""`benchmark.peers` without its peers (CI never installs OpenVINO nor builds llama.cpp): our own measurements run
for real, each in a fresh process, on a tiny exported fixture (eager backend: nothing compiles), the probes run on
the machine, and the report is rendered from the recorded run: every cell our engine fills has a number, the
peers' cells and goals say they are missing, the ratios are the medians' ratios, a rerun of one system merges."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmark import peers
from benchmark.peerbench import figures, plan, report, rounds
from benchmark.peerbench.layout import Layout, PeerMissingError
from optimum.neuron.progress import StepProgress
from tests.fixtures.llm.models import export_fixture, tiny_model

pytestmark = pytest.mark.slow
FIXTURE = "llama-2x4x8-eager"
"""Batch 2, S=32, C=8: its batch stands in for the batch-8 artifact."""
TINY = plan.Plan(
    rounds=2,
    batch=2,
    decode_steps=4,
    decode_context=4,
    prefill_lengths=(8, 17),
    prefill_repeats=1,
    workload_prompts=2,
    workload_prompt_len=10,
    workload_new_tokens=4,
)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two interleaved rounds of our measurements (all but `vllm.LLM`, covered by tests/vllm) on the fixture."""
    layout = Layout(tmp_path_factory.mktemp("peers"))
    artifact = str(export_fixture(FIXTURE))
    prompts = plan.inputs(TINY, last_id=250)
    measures = [
        m for m in rounds.ours_measures(TINY, prompts, {"b1": artifact, "b8": artifact}) if m.name != "vllm.LLM"
    ]
    with StepProgress("tiny peers run", 2 * len(measures)) as bar:
        figures_, log = rounds.run_rounds(layout, TINY.rounds, {"ours": measures}, bar)
    probe = rounds.run_json([sys.executable, "-m", "benchmark.peerbench.probes", str(tiny_model("llama"))], {})
    work = {"prompt_lengths": [len(p) for p in prompts["workload"]], "new_tokens": TINY.workload_new_tokens}
    return {
        "command": "test",
        "rounds": TINY.rounds,
        "systems": ["ours"],
        "started": "start",
        "finished": "end",
        "machine": {"cpu": "test"},
        "versions": {"ours": "test"},
        "settings": peers.settings(TINY),
        "workload": work,
        "prefill_lengths": list(TINY.prefill_lengths),
        "batch": TINY.batch,
        "probes": [probe],
        "figures": figures_,
        "log": log,
    }


def test_our_measurements_fill_every_our_cell(tiny_run: dict[str, Any]) -> None:
    assert not [m for m in tiny_run["log"] if "error" in m], tiny_run["log"]
    assert len(tiny_run["log"]) == 2 * 4 and {m["round"] for m in tiny_run["log"]} == {1, 2}
    for row in ("decode_b1_ms", "decode_b8_ms", "prefill_8_ms", "prefill_17_ms", "workload_tok_s"):
        values = figures.samples(tiny_run, row, figures.OURS)
        assert len(values) == 2 and all(v > 0 for v in values), (row, values)
    generate = [m["result"] for m in tiny_run["log"] if m["measure"] == "generate"]
    assert all(r["tokens"] == TINY.workload_prompts * TINY.workload_new_tokens for r in generate)
    probe = tiny_run["probes"][0]
    assert probe["read_bw_sum"] > 0 and probe["read_bw_gemv"] > 0 and probe["peak_flops"] > 0
    assert probe["weight_bytes"] == 4 * probe["shape"]["params"]


def test_report_renders_our_figures_and_names_the_missing_peers(tiny_run: dict[str, Any], tmp_path: Path) -> None:
    text = report.write(tiny_run, tmp_path).read_text()
    assert (tmp_path / "peers.png").read_bytes().startswith(PNG)
    assert json.loads((tmp_path / "peers.json").read_text()) == tiny_run
    b1, b2 = (statistics.median(figures.samples(tiny_run, r, figures.OURS)) for r in ("decode_b1_ms", "decode_b8_ms"))
    assert f"| decode batch 2 step / our batch-1 step | {b2 / b1:.2f}x" in text
    assert "| decode batch 1: ours / better peer | — | <= 1.0x | n/a |" in text
    assert "| prefill 17: ours / OpenVINO | — | <= 1.0x | n/a |" in text
    row = next(line for line in text.splitlines() if line.startswith("| prefill 17 tokens, ms |"))
    assert row.count("—") == 3, row  # vllm.LLM, OpenVINO, llama.cpp have no prefill figure here
    assert "## Failed measurements" not in text


def test_goal_ratios_use_the_medians_and_the_better_peer(tiny_run: dict[str, Any]) -> None:
    run = json.loads(json.dumps(tiny_run))
    run["figures"]["decode_b1_ms"] |= {figures.OPENVINO: [30.0, 31.0, 29.0], figures.LLAMA: [20.0, 50.0, 21.0]}
    run["figures"]["workload_tok_s"] |= {figures.VLLM: [10.0, 12.0], figures.OPENVINO: [8.0, 9.0]}
    ours_b1 = statistics.median(figures.samples(run, "decode_b1_ms", figures.OURS))
    by_goal = {g.label: g for g in figures.goals(run)}
    ratio, against = figures.goal_ratio(run, by_goal["decode batch 1: ours / better peer"])
    assert against == figures.LLAMA and ratio == pytest.approx(ours_b1 / 21.0)
    ratio, _ = figures.goal_ratio(run, by_goal["workload tok/s: vllm.LLM / OpenVINO CB"])
    assert (
        ratio == pytest.approx(11.0 / 8.5)
        and figures.met(by_goal["workload tok/s: vllm.LLM / OpenVINO CB"], ratio) == "met"
    )


def test_rerun_of_one_system_keeps_the_others(tiny_run: dict[str, Any]) -> None:
    previous = json.loads(json.dumps(tiny_run))
    previous["figures"]["decode_b1_ms"][figures.LLAMA] = [20.0]
    previous["versions"]["llamacpp"] = "b1"
    fresh = json.loads(json.dumps(tiny_run)) | {"started": "later"}
    merged = peers.merge(previous, fresh, ["ours"])
    assert merged["figures"]["decode_b1_ms"][figures.LLAMA] == [20.0]
    assert merged["versions"]["llamacpp"] == "b1" and "ours rerun" in merged["merged"]
    assert len(merged["probes"]) == 2 and merged["systems"] == ["ours"]


def test_a_missing_peer_names_the_setup_command(tmp_path: Path) -> None:
    with pytest.raises(PeerMissingError, match="--setup"):
        peers.check_installed(Layout(tmp_path), ["openvino"])
