"""``optimum-cli neuron cache list | clear | prune`` on a cache built by real (eager) exports of the tiny llama: two
exports differing only in their prefill graph (chunks of 8 with their buckets, a symbolic dimension; a static chunk of
16), so two artifacts and three graph entries (the token-generation one is shared), run the way a user runs the CLI,
against a private copy of that cache per test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optimum.neuron import cache_admin
from optimum.neuron.cache_dir import cache_lock
from optimum.neuron.errors import CacheError
from tests.fixtures.llm.models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
CHUNKS = {8: "auto", 16: "none"}
"""The two exports: prefill chunk size -> chunk buckets (different chunk sizes alone share a symbolic prefill graph)."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding the eager exports of the tiny llama of `CHUNKS`, a converted model and the scratch caches
    (stand-ins: the kernel may have been built into another cache by an earlier test)."""
    from optimum.exporters.neuron.export import cached_export
    from optimum.neuron.config import NeuronConfig

    model = tiny_model("llama")  # from the project's cache: models/ of the built cache is a stand-in
    cache = tmp_path_factory.mktemp("built") / "cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPTIMUM_NEURON_CACHE", str(cache))
        for chunk, buckets in CHUNKS.items():
            config = NeuronConfig(
                batch_size=2,
                sequence_length=32,
                prefill_chunk_size=chunk,
                chunk_buckets=buckets,
                backend="eager",
                decode_logits=False,
            )
            cached_export(model, config)
    stand_ins = ("models/tiny-stand-in", "kernels/stand-in", "inductor/stand-in", "calibrated/stand-in")
    for stand_in in stand_ins:  # built or not by now
        (cache / stand_in).mkdir(parents=True, exist_ok=True)
        (cache / stand_in / "config.json").write_text("{}")
    return cache


@pytest.fixture
def cache(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built cache (``cp -a``: hard links and modification times kept)."""
    copy = tmp_path / "cache"
    subprocess.run(["cp", "-a", str(built), str(copy)], check=True)
    return copy


def cli(cache: Path, *args: str) -> subprocess.CompletedProcess:
    """``optimum-cli neuron cache ARGS`` on ``cache``, run from this checkout (``python -m``)."""
    env = {**os.environ, "OPTIMUM_NEURON_CACHE": str(cache), "COLUMNS": "500"}
    cmd = [sys.executable, "-m", "optimum.commands.optimum_cli", "neuron", "cache", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def listing(cache: Path) -> dict:
    done = cli(cache, "list", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def by_chunk(body: dict) -> dict[int, dict]:
    """The artifacts of ``list --json`` by prefill chunk size."""
    return {row["prefill_chunk_size"]: row for row in body["artifacts"]}


def unique_bytes(*folders: Path) -> int:
    """Bytes of the files under ``folders``, each inode counted once (computed here, not by the tool)."""
    seen: dict[tuple[int, int], int] = {}
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                stat = path.stat()
                seen[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(seen.values())


def entries(cache: Path, kind: str) -> set[str]:
    """The entry folders (no lock, no ``.tmp``) under ``cache/kind``."""
    return {p.name for p in (cache / kind).iterdir() if p.is_dir() and ".tmp" not in p.name}


def test_list_shows_artifacts_shared_graphs_and_totals_counted_once(cache: Path) -> None:
    body = listing(cache)
    assert body["root"] == str(cache)
    artifacts = by_chunk(body)
    assert sorted(artifacts) == sorted(CHUNKS)
    assert all(
        a["model_type"] == "llama" and a["backend"] == "eager" and a["batch_size"] == 2 for a in artifacts.values()
    )
    graphs = {row["key"]: row for row in body["graphs"]}
    assert len(graphs) == 3
    shared = artifacts[8]["graphs"]["token_generation"]
    assert shared == artifacts[16]["graphs"]["token_generation"]
    assert graphs[shared]["graph"] == "token_generation"
    assert sorted(graphs[shared]["referenced_by"]) == sorted(a["key"] for a in artifacts.values())
    for chunk in CHUNKS:
        prefill = graphs[artifacts[chunk]["graphs"]["chunked_prefill"]]
        assert (prefill["graph"], prefill["artifacts"]) == ("chunked_prefill", 1)
    totals = body["totals"]
    assert totals["total"] == unique_bytes(cache / "exports", cache / "graphs")
    assert totals["artifacts"] == unique_bytes(cache / "exports")
    assert totals["total"] < totals["artifacts"] + totals["graphs"], "hard-linked graph files counted twice"
    assert totals["artifacts"] < sum(a["size"] for a in artifacts.values()), "the shared graph file counted twice"


def test_the_table_names_every_entry(cache: Path) -> None:
    done = cli(cache, "list")
    assert done.returncode == 0, done.stderr
    for key in entries(cache, "exports") | entries(cache, "graphs"):
        assert key in done.stdout
    assert f"compile cache: {cache}" in done.stdout


def age(cache: Path, order: list[str]) -> None:
    """Make ``order`` (paths relative to ``cache``) the least to the most recently used."""
    for rank, name in enumerate(order):
        os.utime(cache / name, (1_000_000 + rank * 1000, 1_000_000 + rank * 1000))


def lru_setup(cache: Path) -> tuple[list[str], int]:
    """Entries from least to most recently used (chunk 8's artifact, its prefill graph, chunk 16's artifact, the
    shared graph, chunk 16's prefill graph) and the bytes of the last three, counted once."""
    artifacts = by_chunk(listing(cache))
    order = [
        f"exports/{artifacts[8]['key']}",
        f"graphs/{artifacts[8]['graphs']['chunked_prefill']}",
        f"exports/{artifacts[16]['key']}",
        f"graphs/{artifacts[16]['graphs']['token_generation']}",
        f"graphs/{artifacts[16]['graphs']['chunked_prefill']}",
    ]
    age(cache, order)
    return order, unique_bytes(*(cache / name for name in order[2:]))


def test_prune_removes_the_least_recently_used_first(cache: Path) -> None:
    order, newest = lru_setup(cache)
    dry = cli(cache, "prune", "--max-size", str(newest), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert all((cache / name).is_dir() for name in order), "--dry-run removed something"
    done = cli(cache, "prune", "--max-size", str(newest))
    assert done.returncode == 0, done.stderr
    assert [(cache / name).exists() for name in order] == [False, False, True, True, True]
    removed = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("removed ")]
    assert removed == order[:2], done.stdout
    assert [line.split()[2] for line in dry.stdout.splitlines() if line.startswith("would remove")] == order[:2]
    assert not (cache / f"{order[0]}.lock").exists(), "the removed artifact's lock file is left"
    assert listing(cache)["totals"]["total"] == newest == unique_bytes(cache / "exports", cache / "graphs")


def test_prune_never_removes_an_entry_whose_lock_is_held(cache: Path) -> None:
    order, newest = lru_setup(cache)
    oldest = cache / order[0]
    with cache_lock(oldest.with_name(f"{oldest.name}.lock")) as held:
        assert held
        done = cli(cache, "prune", "--max-size", str(newest))
    assert done.returncode == 0, done.stderr
    assert oldest.is_dir() and (oldest / "neuron_config.json").is_file()
    assert f"kept {order[0]}: in use by another process" in done.stdout
    assert not (cache / order[1]).exists(), "prune stopped at the held entry instead of going on"


def test_prune_removes_stale_staging_folders_only(cache: Path) -> None:
    """A ``.tmp<pid>`` folder of a dead process goes; one of a live process (this one) stays."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = cache / "graphs" / f"0123456789abcdef0123.tmp{int(gone.stdout)}"
    live = cache / "exports" / f"fedcba9876543210.tmp{os.getpid()}"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "token_generation.json").write_text("{}")
    before = entries(cache, "exports") | entries(cache, "graphs")
    done = cli(cache, "prune", "--max-size", "1T")
    assert done.returncode == 0, done.stderr
    assert not stale.exists() and live.is_dir()
    assert entries(cache, "exports") | entries(cache, "graphs") == before, "prune under the size removed entries"
    assert f"kept exports/{live.name}: being built by process {os.getpid()}" in done.stdout


def test_clear_empties_exports_and_graphs_and_keeps_models(cache: Path) -> None:
    held = next(iter(entries(cache, "graphs")))
    with cache_lock(cache / "graphs" / f"{held}.lock") as taken:
        assert taken
        done = cli(cache, "clear")
    assert done.returncode == 0, done.stderr
    assert f"kept graphs/{held}: in use by another process" in done.stdout
    assert not list((cache / "exports").iterdir())
    assert sorted(p.name for p in (cache / "graphs").iterdir()) == sorted([held, f"{held}.lock"])
    assert (cache / "models" / "tiny-stand-in" / "config.json").is_file()
    for scratch in ("kernels", "calibrated"):
        assert any((cache / scratch).iterdir()), f"clear without --all took {scratch}/"
    again = cli(cache, "clear", "--all")
    assert again.returncode == 0, again.stderr
    for scratch in ("graphs", "kernels", "inductor", "calibrated"):
        assert not list((cache / scratch).iterdir()), scratch
    assert (cache / "models" / "tiny-stand-in" / "config.json").is_file()
    assert "freed" in again.stdout


@pytest.mark.parametrize("args", [["--max-size", "2X"], ["--max-size", "-1G"], []])
def test_a_bad_max_size_is_refused_naming_the_flag(cache: Path, args: list[str]) -> None:
    before = unique_bytes(cache)
    done = cli(cache, "prune", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--max-size" in done.stderr and "Traceback" not in done.stderr
    assert unique_bytes(cache) == before


@pytest.mark.parametrize(
    ("text", "size"),
    [("2G", 2 << 30), ("500M", 500 << 20), ("1.5GB", 3 << 29), ("10GiB", 10 << 30), ("1048576", 1 << 20), ("4k", 4096)],
)
def test_sizes(text: str, size: int) -> None:
    assert cache_admin.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "2X", "-1G", "1.5.5G", "2 GB extra"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(CacheError, match="is not a size"):
        cache_admin.parse_size(text)


def test_the_layout_names_match_the_exporter() -> None:
    """`cache_admin` imports no torch, so it spells the exporter's names itself: they must agree."""
    from optimum.exporters.neuron import graph_cache
    from optimum.neuron import artifact, config

    assert cache_admin.GRAPHS == graph_cache.GRAPHS_FOLDER and cache_admin.ENTRY_FILE == graph_cache.ENTRY_FILE
    assert cache_admin.CONFIG_FILE == config.CONFIG_FILE
    assert tuple(cache_admin.MANIFEST.split("/")) == (artifact.GRAPHS_DIR, artifact.MANIFEST_FILE)


def test_the_cache_tools_import_no_torch() -> None:
    code = "import sys, optimum.neuron.cache_cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "False"
