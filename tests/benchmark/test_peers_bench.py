"""`benchmark.peers` without its peers (CI never installs OpenVINO nor builds llama.cpp): our own measurements run
for real, each in a fresh process, on a tiny exported fixture (eager backend: nothing compiles), the probes run on
the machine, and the report is rendered from the recorded run: every cell our engine fills has a number, the
peers' cells and goals say they are missing, the ratios are the medians' ratios, a rerun of one system merges."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmark import peers
from benchmark.peerbench import figures, formats, install, plan, probes, report, rounds
from benchmark.peerbench.layout import Layout, PeerMissingError
from optimum.neuron.progress import StepProgress
from tests.fixtures.llm.models import export_fixture, tiny_model

pytestmark = pytest.mark.slow
FIXTURE = "llama-2x4x8-eager"
"""Batch 2, S=32, C=8: its batch stands in for the batch-8 artifact."""
TINY = plan.Plan(
    rounds=1,
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
    """One round of our measurements (all but `vllm.LLM`, covered by tests/vllm) on the fixture: four fresh processes
    (a second round would only repeat them; the medians over rounds are checked on recorded figures below)."""
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
        "decode_positions": plan.decode_positions(TINY),
        "probes": [probe],
        "figures": figures_,
        "log": log,
    }


def test_our_measurements_fill_every_our_cell(tiny_run: dict[str, Any]) -> None:
    assert not [m for m in tiny_run["log"] if "error" in m], tiny_run["log"]
    assert len(tiny_run["log"]) == 4 and {m["round"] for m in tiny_run["log"]} == {1}
    for row in ("decode_b1_ms", "decode_b8_ms", "prefill_8_ms", "prefill_17_ms", "workload_tok_s"):
        values = figures.samples(tiny_run, row, figures.OURS)
        assert len(values) == 1 and all(v > 0 for v in values), (row, values)
    generate = [m["result"] for m in tiny_run["log"] if m["measure"] == "generate"]
    assert all(r["tokens"] == TINY.workload_prompts * TINY.workload_new_tokens for r in generate)
    probe = tiny_run["probes"][0]
    assert probe["read_bw_sum"] > 0 and probe["read_bw_gemv"] > 0 and probe["peak_flops"] > 0
    assert set(probe["gemm_flops"]) == {"torch", "packed"} and probe["peak_flops"] == max(probe["gemm_flops"].values())
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


def test_decode_floors_count_the_kv_cache_each_step_reads(tiny_run: dict[str, Any]) -> None:
    """A decode row's bandwidth floor counts the KV cache its steps read at the run's mean context (rows x positions x
    layers x keys and values x KV width x 4 bytes) on top of the weights, which are all a prefill row counts; a run
    recorded before the probes held the KV width renders its floors as it did."""
    shape = tiny_run["probes"][0]["shape"]
    per_position = shape["layers"] * 2 * shape["kv_width"] * 4
    assert per_position > 0
    bandwidth = figures.machine_limits(tiny_run)["read_bw"]
    bounds = figures.floors(tiny_run)
    weights_ms = bounds[f"prefill_{TINY.prefill_lengths[0]}_ms"]["bytes_ms"]
    positions = TINY.decode_context + plan.DECODE_WARMUP + (TINY.decode_steps + 1) / 2
    for key, rows in (("decode_b1_ms", 1), ("decode_b8_ms", TINY.batch)):
        kv_ms = 1000 * rows * positions * per_position / bandwidth
        assert bounds[key]["bytes_ms"] - weights_ms == pytest.approx(kv_ms)
    older = {**tiny_run, "probes": [{**p, "shape": {**p["shape"], "kv_width": 0}} for p in tiny_run["probes"]]}
    del older["decode_positions"]
    assert figures.floors(older)["decode_b8_ms"]["bytes_ms"] == pytest.approx(weights_ms)
    assert "predates" in report.kv_counted(older)
    assert f"{positions:.0f} positions" in report.kv_counted(tiny_run)


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


def test_each_goal_is_also_taken_within_each_round(tiny_run: dict[str, Any], tmp_path: Path) -> None:
    """Beside the ratio of medians (the verdict), the report gives the goal's ratio within each round, over the rounds
    where both sides were measured: a slow spell of the machine weighs on both sides of a round's ratio. A merged run's
    systems measured on different days are not paired. `--render` refuses a missing file, a file that is not JSON and
    another JSON, each naming the file to pass."""
    run = json.loads(json.dumps(tiny_run))
    ours, openvino = [100.0, 300.0, 120.0, None], [80.0, 200.0, 400.0, 90.0]
    run["figures"]["prefill_8_ms"] = {figures.OURS: ours, figures.OPENVINO: openvino}
    goal = next(g for g in figures.goals(run) if g.row == "prefill_8_ms")
    assert figures.goal_ratio(run, goal) == (pytest.approx(120.0 / 145.0), figures.OPENVINO)
    assert figures.paired_ratios(run, goal, figures.OPENVINO) == pytest.approx([1.25, 1.5, 0.3])
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(run))
    peers.main(["--render", str(path)])
    line = next(x for x in (tmp_path / "peers.md").read_text().splitlines() if x.startswith("| prefill 8: "))
    assert line.endswith("| 0.83x (vs OpenVINO GenAI) | <= 1.0x | met | 1.25x (0.30–1.50) |"), line
    assert json.loads(path.read_text()) == run and not (tmp_path / "peers.png").exists()
    merged = run | {"measured": {"ours": "friday", "openvino": "monday"}}  # OpenVINO kept from an earlier run
    assert figures.paired_ratios(merged, goal, figures.OPENVINO) == []
    assert report.per_round(merged, goal, figures.OPENVINO) == "—"
    with pytest.raises(SystemExit, match="no recorded run"):
        peers.main(["--render", str(tmp_path / "missing.json")])
    (tmp_path / "notes.json").write_text("rounds: 8")
    with pytest.raises(SystemExit, match=r"is not JSON .* benchmark\.peers"):
        peers.main(["--render", str(tmp_path / "notes.json")])
    (tmp_path / "other.json").write_text(json.dumps({"cells": {}, "rounds": 2}))
    with pytest.raises(SystemExit, match=r"is not a peers run \(no command, systems, figures"):
        peers.main(["--render", str(tmp_path / "other.json")])
    assert not (tmp_path / "notes.md").exists() and not (tmp_path / "other.md").exists()


def test_the_machine_s_multiply_adds_are_recorded_before_each_measurement(tiny_run: dict[str, Any]) -> None:
    """Before each measurement the run records the packed kernel's in-cache rate on one thread and on two
    (`probes.core_rates`, torch's thread count left as it was); the report gives each round's median two-thread rate
    and its two-over-one scaling; a run recorded before that has no such line."""
    rates = [m["compute"] for m in tiny_run["log"]]
    assert len(rates) == 4 and all(r["one"] > 1e9 and r["two"] > 1e9 for r in rates), rates
    threads = torch.get_num_threads()
    assert set(probes.core_rates(0.01)) == {"one", "two"} and torch.get_num_threads() == threads
    (line,) = [x for x in report.render(tiny_run).splitlines() if x.startswith("Multiply-adds the machine gave")]
    (only,) = figures.round_compute(tiny_run)
    assert f"1: {only.two / 1e9:.0f} GFLOP/s ({only.scaling:.2f}x)" in line, line
    log = [
        {"round": 1, "compute": {"one": 1e11, "two": 2e11}},
        {"round": 1, "compute": {"one": 1e11, "two": 1.2e11}},
        {"round": 1, "compute": {"one": 1e11, "two": 1.6e11}},
        {"round": 2, "compute": {"one": 1.5e11, "two": 1.5e11}},
        {"round": 2, "error": "an entry recorded without a rate is left out"},
    ]
    assert figures.round_compute({"log": log}) == [
        figures.RoundCompute(1, 1.6e11, pytest.approx(1.6)),
        figures.RoundCompute(2, 1.5e11, 1.0),
    ]
    older = {**tiny_run, "log": [{k: v for k, v in m.items() if k != "compute"} for m in tiny_run["log"]]}
    assert not figures.round_compute(older) and "Multiply-adds" not in report.render(older)


def test_rerun_of_one_system_keeps_the_others(tiny_run: dict[str, Any]) -> None:
    previous = json.loads(json.dumps(tiny_run))
    previous["figures"]["decode_b1_ms"][figures.LLAMA] = [20.0]
    previous["versions"]["llamacpp"] = "b1"
    previous["formats"] = {"ours": {"format": "old"}, "llamacpp": {"format": "Q8_0 file"}}
    fresh = json.loads(json.dumps(tiny_run)) | {"started": "later", "formats": {"ours": {"format": "new"}}}
    merged = peers.merge(previous, fresh, ["ours"])
    assert merged["formats"] == {"llamacpp": {"format": "Q8_0 file"}, "ours": {"format": "new"}}
    assert merged["figures"]["decode_b1_ms"][figures.LLAMA] == [20.0]
    assert merged["versions"]["llamacpp"] == "b1" and "ours rerun" in merged["merged"]
    assert len(merged["probes"]) == 2 and merged["systems"] == ["ours"]


def test_a_second_merge_keeps_each_systems_own_date(tiny_run: dict[str, Any]) -> None:
    """A system kept through two partial reruns is dated by the run that measured it, not by the last merge."""
    first = json.loads(json.dumps(tiny_run)) | {"started": "monday", "systems": ["ours", "openvino", "llamacpp"]}
    second = peers.merge(first, json.loads(json.dumps(tiny_run)) | {"started": "tuesday"}, ["ours", "llamacpp"])
    third = peers.merge(second, json.loads(json.dumps(tiny_run)) | {"started": "friday"}, ["ours", "llamacpp"])
    assert third["measured"] == {"ours": "friday", "openvino": "monday", "llamacpp": "friday"}
    assert third["merged"] == "ours, llamacpp rerun; openvino from the run of monday"


def test_a_missing_peer_names_the_setup_command(tmp_path: Path) -> None:
    with pytest.raises(PeerMissingError, match="--setup"):
        peers.check_installed(Layout(tmp_path), ["openvino"])


@pytest.mark.parametrize(
    ("fmt", "gguf_type", "ir", "stem"),
    [
        ("fp32", "F32", "openvino-ir-fp32", "peers"),  # the names fp32 always had
        ("int8", "Q8_0", "openvino-ir-int8", "peers-int8"),
        ("int4", "Q4_0", "openvino-ir-int4-g64", "peers-int4"),
    ],
)
def test_each_weight_format_has_its_own_files(tmp_path: Path, fmt: str, gguf_type: str, ir: str, stem: str) -> None:
    layout = Layout(tmp_path, fmt)
    assert layout.openvino_ir == tmp_path / ir and report.stem(fmt) == stem
    assert layout.gguf == tmp_path / f"smollm2-135m-instruct-{gguf_type.lower()}.gguf"
    assert layout.f32_gguf == tmp_path / "smollm2-135m-instruct-f32.gguf" and layout.model == Layout(tmp_path).model
    steps = install.steps(fmt)
    assert steps["llamacpp"][-1].name.startswith(f"{gguf_type} GGUF") and steps["ours"] == steps["openvino"][:1]
    args = install.openvino_format_args(fmt)
    assert args[:2] == ["--weight-format", fmt] and (args[2:] == ["--group-size", "64"]) == (fmt == "int4")
    assert figures.labels({"weight_format": fmt})[figures.LLAMA] == f"llama.cpp {gguf_type}"
    assert "|" not in "".join(formats.DESCRIPTIONS[fmt].values())  # each sits in a markdown table's cell


def test_a_missing_quantized_model_names_its_setup_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "openvino-ir-fp32").mkdir()  # the fp32 files do not stand in for the int4 ones
    (tmp_path / "smollm2-135m-instruct-f32.gguf").write_bytes(b"")
    for system in ("openvino", "llamacpp"):
        with pytest.raises(
            PeerMissingError, match=re.escape("`python -m benchmark.peers --setup --weight-format int4`")
        ):
            peers.check_installed(Layout(tmp_path, "int4"), [system])
    with pytest.raises(SystemExit):
        peers.main(["--weight-format", "int2"])
    assert "invalid choice: 'int2'" in capsys.readouterr().err


@pytest.mark.parametrize(("fmt", "head"), [("int8", "float"), ("int4", "float"), ("int8", "int8")])
def test_decode_bytes_of_our_quantized_artifact(fmt: str, head: str) -> None:
    """The floor's bytes, counted from the artifact's safetensors header, are those the scheme predicts from the
    config (1 or half a byte per linear weight, fp32 scales, the embedding stored once: tied; fp32, or int8 under
    ``--lm_head_format int8``) and well under fp32."""
    artifact = export_fixture(f"llama-2x4x8-{fmt}{'' if head == 'float' else '-headint8'}-eager")
    tensors = formats.safetensors_tensors(artifact / "model.safetensors")
    counted = formats.decode_bytes(tensors)
    assert counted["tied"] and counted["decode"] == counted["stored"] == sum(b for _, b in tensors.values())
    assert counted["embedding"] == (4 if head == "float" else 1) * 256 * 64
    stored = formats.by_type(tensors)
    assert set(stored) == {"F32", "I8" if fmt == "int8" else "U8"}
    shape = probes.model_shape(tiny_model("llama"))
    # the artifact also stores the rotary frequencies (head_dim / 2 floats), which the config's count leaves out
    assert 0 <= counted["decode"] - formats.config_decode_bytes(shape, fmt, head) <= 4 * 64
    assert counted["decode"] < 0.6 * probes.weight_bytes(shape)


def test_an_untied_lm_head_leaves_the_embedding_table_out(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(10, 4),
            "lm_head.weight": torch.zeros(10, 4),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4, dtype=torch.int8),
            "model.layers.0.mlp.up_proj.weight_scale": torch.zeros(8, 1),
        },
        tmp_path / "model.safetensors",
    )
    counted = formats.decode_bytes(formats.safetensors_tensors(tmp_path / "model.safetensors"))
    assert counted == {"stored": 160 + 160 + 32 + 32, "embedding": 160, "tied": False, "decode": 160 + 32 + 32}
    shape = {"params": 2 * 40 + 32 + 5, "linear_params": 32, "linear_rows": 8, "lm_head_params": 40, "tied": 0}
    assert formats.config_decode_bytes(shape, "int8") == 4 * (40 + 5) + 32 + 4 * 8
    # an int8 LM head: its 40 weights one byte each, one fp32 scale per vocabulary row
    assert formats.config_decode_bytes(shape | {"vocab": 10}, "int8", "int8") == 4 * 5 + 32 + 4 * 8 + 40 + 4 * 10


def test_openvino_constants_by_element_type(tmp_path: Path) -> None:
    (tmp_path / "m.xml").write_text(
        '<net><layers><layer id="0" type="Const"><data element_type="u4" shape="8, 64" offset="0" size="256"/>'
        '</layer><layer id="1" type="Const"><data element_type="f16" shape="8, 1" offset="256" size="16"/></layer>'
        '<layer id="2" type="Parameter"><data element_type="f32" shape="1, 64"/></layer>'
        '<layer id="3" type="Const"><data element_type="u4" shape="8, 1" offset="272" size="4"/></layer></layers></net>'
    )
    assert formats.openvino_constants(tmp_path / "m.xml") == {"u4": 260, "f16": 16}


def test_quantized_report_names_its_format_and_counts_the_floor_from_the_artifact(
    tiny_run: dict[str, Any], tmp_path: Path
) -> None:
    run = json.loads(json.dumps(tiny_run)) | {"weight_format": "int8", "systems": ["ours"]}
    artifact = export_fixture("llama-2x4x8-int8-eager")
    run["formats"] = formats.describe(Layout(tmp_path, "int8"), ["ours", "openvino"], str(artifact))
    assert run["formats"]["openvino"]["error"].startswith(("FileNotFoundError", "OSError"))  # no IR here: no crash
    run["formats"]["openvino"]["plugin"] = {
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32",
        "kernels": {"FullyConnected, brgemm_avx512_f32, u8": 211},
        "default": {"forward_256_ms": 235.0, "decode_ms": 18.8},
        "dynamic_quantization_off": {"forward_256_ms": 452.0, "decode_ms": 21.8},
    }
    counted = run["formats"]["ours"]["decode_bytes"]["decode"]
    assert figures.decode_bytes(run) == (counted, "artifact")
    bandwidth = figures.machine_limits(run)["read_bw"]
    kv = figures.kv_bytes(run, 1, run["decode_positions"])  # the cache a step reads (its own test above)
    assert figures.floors(run)["decode_b1_ms"]["bytes_ms"] == pytest.approx(1000 * (counted + kv) / bandwidth)
    text = report.write(run, tmp_path).read_text()
    assert (tmp_path / "peers-int8.json").is_file() and (tmp_path / "peers-int8.png").read_bytes().startswith(PNG)
    assert not (tmp_path / "peers.md").exists()
    assert text.startswith("# Peers on this CPU: SmolLM2-135M-Instruct int8 weights (llama.cpp Q8_0)")
    assert "llama.cpp Q8_0" in text and "![peers](peers-int8.png)" in text and "## Weight formats (int8)" in text
    assert f"Bytes a decode step of ours reads: {counted / 1e6:,.1f} MB, counted from our batch-1 artifact" in text
    assert (
        "per output channel" in text and "| OpenVINO GenAI | `optimum-cli export openvino --weight-format int8`" in text
    )
    assert (
        "`DYNAMIC_QUANTIZATION_GROUP_SIZE=32`" in text
        and "256 tokens 235 ms with the default, 452 ms with it off" in text
    )
    # without our artifact (e.g. `--only openvino`), the floor's bytes come from the config under our scheme
    del run["formats"]
    shape = run["probes"][0]["shape"]
    assert figures.decode_bytes(run) == (formats.config_decode_bytes(shape, "int8", "int8"), "config")


def test_peer_quality_report_gives_each_systems_ratio_to_its_own_fp32() -> None:
    from benchmark import peer_quality
    from benchmark.machine import describe

    figures = {"ours": (13.1, 13.16, 20.1), "openvino": (13.0, 13.2, 15.6), "llamacpp": (9.0, 9.1, 11.7)}
    formats = ("fp32", "int8", "int4")
    systems = {s: {f: {"perplexity": p} for f, p in zip(formats, v, strict=True)} for s, v in figures.items()}
    text = peer_quality.render({"machine": describe(), "tokens": 4096, "window": 1024, "systems": systems})
    assert "| ours | 13.100 | 1.000 | 13.160 | 1.005 | 20.100 | 1.534 |" in text
    assert "| llama.cpp (its own protocol) | 9.000 | 1.000 | 9.100 | 1.011 | 11.700 | 1.300 |" in text
    assert "4 windows of 1,024 tokens" in text
