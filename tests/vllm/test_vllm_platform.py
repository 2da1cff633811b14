"""The platform fits vLLM's configuration to the artifact and refuses what it cannot serve, with the
flag to change (vLLM's real config path: ``EngineArgs.create_engine_config``, no engine started)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.artifacts import edit_json
from tests.fixtures.llm.models import export_fixture
from tests.utils import subprocess_test

pytestmark = [pytest.mark.vllm]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


def bad_drafts(tmp_path: Path, draft: Path) -> list[tuple[Path, list[str]]]:
    """Draft models the platform refuses, with what its message names: a transformers folder, an artifact of two ranks,
    one without a chunked-prefill graph, one with fewer slots than the target, one of another vocabulary."""
    from optimum.neuron.artifact import read_config
    from tests.fixtures.llm.models import tiny_model

    smaller, other_vocab = tmp_path / "draft-batch1", tmp_path / "draft-vocab"
    for copy in (smaller, other_vocab):
        shutil.copytree(draft, copy)
    one_slot = dataclasses.replace(read_config(draft), batch_size=1, kv_cache_tokens=0)
    body = json.loads((draft / "neuron_config.json").read_text())
    (smaller / "neuron_config.json").write_text(one_slot.to_json(body["graphs"], body.get("recorded")))
    edit_json(other_vocab / "config.json", lambda body: body.update(vocab_size=300))
    return [
        (tiny_model("qwen3"), ["not an optimum-neuronx artifact", "optimum-cli export neuron"]),
        (export_fixture("llama-2x4x8-kv1-tp2-eager"), ["tp_degree=2", "--tensor_parallel_size 1"]),
        (export_fixture("llama-2x1x32-ce-eager"), ["prefill_chunk_size=0", "--prefill_chunk_size C > 0"]),
        (smaller, ["batch_size=1", "--batch_size >= 2"]),
        (other_vocab, ["same vocabulary size"]),  # vLLM's own check
    ]


def engine_config(model: Path, **kwargs: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), **kwargs).create_engine_config()


@subprocess_test
def test_limits_come_from_the_artifact_and_excess_is_refused(tmp_path: Path) -> None:
    chunked, ce = export_fixture("llama-2x4x8-eager"), export_fixture("llama-2x1x32-ce-eager")
    spec3 = export_fixture("llama-2x4x8-spec3-eager")
    config = engine_config(chunked)
    sched = config.scheduler_config
    assert (sched.max_num_seqs, config.model_config.max_model_len) == (2, 32)
    assert sched.enable_chunked_prefill and sched.max_num_batched_tokens == 8, "token budget = one chunk"
    assert engine_config(chunked, max_num_batched_tokens=24).scheduler_config.max_num_batched_tokens == 24, "asked"
    assert config.parallel_config.worker_cls == "optimum.neuron.vllm.worker.NeuronxWorker"
    cache = config.cache_config  # vLLM places requests in the artifact's paged cache, prefix caching on
    assert (cache.block_size, cache.num_gpu_blocks_override, cache.enable_prefix_caching) == (4, 2 * 32 // 4 + 1, True)
    assert not engine_config(chunked, enable_prefix_caching=False).cache_config.enable_prefix_caching
    assert engine_config(chunked, num_gpu_blocks_override=9).cache_config.num_gpu_blocks_override == 9
    sync = "optimum.neuron.vllm.scheduler.NeuronxScheduler", "optimum.neuron.vllm.scheduler.NeuronxAsyncScheduler"
    sched = config.scheduler_config  # a CPU artifact: vLLM's default (async) is turned off, an explicit choice kept
    assert (sched.async_scheduling, sched.scheduler_cls) == (False, sync[0])
    for asked in (True, False):
        sched = engine_config(chunked, async_scheduling=asked).scheduler_config
        assert (sched.async_scheduling, sched.scheduler_cls) == (asked, sync[asked]), asked
    config = engine_config(ce)
    assert not config.cache_config.enable_prefix_caching, "context encoding cannot start past a cached prefix"
    assert not config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.max_num_batched_tokens >= 32, "a context-encoding artifact needs whole prompts"
    assert engine_config(ce, max_num_batched_tokens=40).scheduler_config.max_num_batched_tokens == 40, "asked, whole"
    with pytest.raises(Exception) as info:  # vLLM re-raises it as a pydantic ValidationError quoting it
        engine_config(ce, max_num_batched_tokens=16)
    assert "--max-num-batched-tokens 16 is below 34" in "".join(str(e) for e in _chain(info.value))
    assert engine_config(chunked, max_model_len=16).model_config.max_model_len == 16
    speculating = engine_config(spec3, speculative_config=NGRAM)  # vLLM's n-gram drafts, verified by the artifact
    assert speculating.speculative_config.num_speculative_tokens == 3
    assert not speculating.scheduler_config.async_scheduling, "the worker drafts between synchronous steps"
    every = {"verify_every_proposal": True}  # n-gram proposals verified even where that does not pay
    assert engine_config(spec3, speculative_config=NGRAM, additional_config=every).additional_config == every
    lora2 = export_fixture("llama-2x4x8-lora2-eager")  # two adapter slots of rank 8
    lora = engine_config(lora2, enable_lora=True, max_loras=2, max_lora_rank=8).lora_config
    assert (lora.max_loras, lora.max_lora_rank) == (2, 8)
    draft = export_fixture("qwen3-2x4x8-eager")  # another model, the same vocabulary: a draft artifact
    drafting = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    speculating = engine_config(spec3, speculative_config=drafting)
    assert speculating.speculative_config.method == "draft_model"
    assert not speculating.scheduler_config.async_scheduling
    refusals = [
        ({"max_num_seqs": 3}, ["max_num_seqs=3", "batch_size=2", "--batch_size"]),
        ({"max_num_seqs": 128}, ["max_num_seqs=128", "batch_size=2"]),  # vLLM's defaults, given explicitly
        ({"max_num_seqs": 256}, ["max_num_seqs=256", "batch_size=2"]),
        ({"max_model_len": 64}, ["max_model_len=64", "sequence_length=32", "--sequence_length"]),
        ({"tensor_parallel_size": 2}, ["--tensor-parallel-size 2", "1 tensor-parallel", "--tensor_parallel_size 2"]),
        ({"pipeline_parallel_size": 2}, ["pipeline parallelism", "--pipeline-parallel-size"]),
        ({"num_gpu_blocks_override": 18}, ["--num-gpu-blocks-override 18", "17 blocks", "--kv_cache_tokens"]),
        ({"enable_prefix_caching": True, "model": ce}, ["needs a chunked-prefill graph", "--prefill_chunk_size"]),
        ({"speculative_config": NGRAM}, ["no verification graph", "--speculation_length"]),
        ({"model": spec3, "speculative_config": {**NGRAM, "num_speculative_tokens": 4}}, ["--speculation_length 4"]),
        ({"model": spec3, "speculative_config": NGRAM, "async_scheduling": True}, ["async scheduling is only"]),
        ({"model": spec3, "speculative_config": {**NGRAM, "method": "ngram_gpu"}}, ["'ngram_gpu'", "draft_model"]),
        ({"model": spec3, "speculative_config": drafting, "async_scheduling": True}, ["--async-scheduling"]),
        ({"additional_config": {"verify_every": True}}, ["['verify_every']", '{"verify_every_proposal": true}']),
        ({"additional_config": {"verify_every_proposal": "yes"}}, ['"verify_every_proposal" takes true or false']),
        ({"enable_lora": True, "max_lora_rank": 8}, ["--enable-lora", "--max_loras N", "docs/lora.md"]),
        ({"model": lora2, "enable_lora": True, "max_loras": 3, "max_lora_rank": 8}, ["--max-loras 2", "--max_loras 3"]),
        ({"model": lora2, "enable_lora": True, "max_lora_rank": 16}, ["--max-lora-rank 8", "--max_lora_rank 16"]),
        *(
            ({"model": spec3, "speculative_config": {**drafting, "model": str(path)}}, fragments)
            for path, fragments in bad_drafts(tmp_path, draft)
        ),
    ]
    for kwargs, fragments in refusals:
        with pytest.raises(Exception) as info:
            engine_config(kwargs.pop("model", chunked), **kwargs)
        text = "".join(str(e) for e in _chain(info.value))
        for fragment in fragments:
            assert fragment in text, (kwargs, text)
    assert engine_config(chunked).scheduler_config.max_num_seqs == 2, "vLLM's default is still lowered"
    assert engine_config(chunked, max_num_seqs=1).scheduler_config.max_num_seqs == 1
    tp2 = export_fixture("llama-2x4x8-kv1-tp2-eager")
    parallel = engine_config(tp2).parallel_config  # the degree comes from the artifact
    assert (parallel.tensor_parallel_size, parallel.world_size, parallel.distributed_executor_backend) == (2, 2, "mp")
    assert engine_config(tp2, tensor_parallel_size=2).parallel_config.world_size == 2
    with pytest.raises(Exception) as info:
        engine_config(tp2, tensor_parallel_size=4)
    assert "--tensor_parallel_size 4" in "".join(str(e) for e in _chain(info.value))
    padded_artifact = export_fixture("llama-2x4x8-h6-kv3-tp2-eager")  # 6 / 3 heads, computed as 8 / 4
    recorded = json.loads((padded_artifact / "neuron_config.json").read_text())["recorded"]
    assert recorded["attention_heads"] == {"heads": 8, "kv_heads": 4}, "the export records the heads it compiled"
    padded = engine_config(padded_artifact)
    arch = padded.model_config.model_arch_config
    assert (arch.total_num_attention_heads, arch.total_num_kv_heads) == (8, 4), "vLLM told the padded heads"
    padded.__post_init__()  # what vLLM's engine core re-runs at start-up, with the degree already set
    unrecorded = tmp_path / "unrecorded"
    shutil.copytree(padded_artifact, unrecorded)
    edit_json(unrecorded / "neuron_config.json", lambda body: body.pop("recorded"))  # an earlier export
    with pytest.raises(Exception) as info:
        engine_config(unrecorded)
    text = "".join(str(e) for e in _chain(info.value))
    assert "attention heads" in text and "re-export" in text, text
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "config.json").write_text((chunked / "config.json").read_text())
    with pytest.raises(Exception) as info:
        engine_config(folder)
    text = "".join(str(e) for e in _chain(info.value))
    assert "not an optimum-neuronx artifact" in text and "optimum-cli export neuron" in text, text


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from. vLLM re-raises our `IncompatibleConfigError` as a
    pydantic ``ValidationError`` that quotes its message (without chaining it), so tests read the text."""
    out: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in out:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


HUMMING_BUILDS = "HUMMING_DISABLE_PARALLEL_BUILD"


@subprocess_test
def test_a_config_built_through_the_platform_mends_the_worker_start_and_the_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``vllm serve`` and ``vllm.LLM`` do before their engine core starts: humming's background builds are off
    for the processes started after it (a value the user set stays), and vLLM's kill of a shutdown's leftovers skips
    a process that ended mid-walk (`compat.tolerate_ended_processes`)."""
    import os

    import vllm.v1.utils as v1_utils

    artifact = export_fixture("llama-2x4x8-eager")
    monkeypatch.delenv(HUMMING_BUILDS, raising=False)
    engine_config(artifact)
    assert os.environ[HUMMING_BUILDS] == "1"
    assert getattr(v1_utils.kill_process_tree, "tolerates_ended_processes", False), "the shutdown's kill is wrapped"
    monkeypatch.setenv(HUMMING_BUILDS, "0")
    engine_config(artifact)
    assert os.environ[HUMMING_BUILDS] == "0", "the user's own setting"


SLEEPS_WITH_A_CHILD = (
    "import subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print(child.pid, flush=True); time.sleep(60)"
)


@subprocess_test
def test_a_process_that_ends_while_vllm_kills_a_tree_does_not_stop_the_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``kill_process_tree`` lists a tree, then names each process before killing it. A process listed but
    ended and collected before its turn (a real one; only the listing is arranged, as it happens when a worker's
    short-lived helper exits mid-walk) made vLLM's own function raise ``psutil.NoSuchProcess``, which left
    ``vllm serve``'s HTTP server running after its shutdown; wrapped, the rest of the tree is killed."""
    import signal
    import subprocess
    import sys

    import psutil
    import vllm.v1.utils as v1_utils

    from optimum.neuron.vllm import compat

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = psutil.Process(ended.pid)
    ended.wait()
    tree = subprocess.Popen([sys.executable, "-c", SLEEPS_WITH_A_CHILD], stdout=subprocess.PIPE)
    assert tree.stdout is not None
    child = psutil.Process(int(tree.stdout.readline()))
    listing = psutil.Process.children
    listed: list[int] = []

    def children(self: psutil.Process, recursive: bool = False) -> list[psutil.Process]:
        found = listing(self, recursive=recursive)
        listed.append(len(found))
        return [gone, *found] if len(listed) == 1 else found  # the ended process: in the first listing only

    monkeypatch.setattr(psutil.Process, "children", children)
    with pytest.raises(psutil.NoSuchProcess):
        v1_utils.kill_process_tree(tree.pid)  # vLLM's own stops at the ended process: nothing of the tree is killed
    assert tree.poll() is None and child.status() != psutil.STATUS_ZOMBIE
    listed.clear()
    monkeypatch.setattr(v1_utils, "kill_process_tree", v1_utils.kill_process_tree)  # restored after the test
    compat.tolerate_ended_processes()
    v1_utils.kill_process_tree(tree.pid)
    assert tree.wait(timeout=30) == -signal.SIGKILL
    assert len(listed) == 2, "walked again after the ended process"
    psutil.wait_procs([child], timeout=30)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, "the root's child is killed too"
