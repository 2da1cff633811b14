"""`scripts/docs_check.py`: which blocks run, what makes one fail, and that nothing it starts survives."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def docs_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_check", ROOT / "scripts" / "docs_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_check"] = module
    spec.loader.exec_module(module)
    return module


DOC = """# A page

```bash
echo not marked
```

<!-- docs-check -->
```bash
echo first
```

<!-- docs-check expect="hello" -->
```sh
echo hello world
```

<!-- docs-check venv=".venv-other" expect="x" -->
```bash
exit 1
```
"""


def test_only_marked_blocks_run_with_their_expected_text(docs_check: ModuleType) -> None:
    Block = docs_check.Block
    assert docs_check.runnable_blocks(DOC) == [
        Block("echo first"),
        Block("echo hello world", expect="hello"),
        Block("exit 1", expect="x", venv=".venv-other"),
    ]


def test_an_unknown_marker_attribute_is_refused(docs_check: ModuleType) -> None:
    with pytest.raises(ValueError, match="expekt"):
        docs_check.runnable_blocks('<!-- docs-check expekt="x" -->\n```bash\ntrue\n```\n')


def test_blocks_of_another_venv_are_left_to_it(docs_check: ModuleType, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(DOC)
    assert docs_check.check_file(page) == 0  # the `exit 1` block belongs to .venv-other
    assert docs_check.check_file(page, ".venv-other") == 1  # which does not exist: counted as failed


def test_verdict_fails_on_exit_status_and_on_missing_text(docs_check: ModuleType) -> None:
    assert docs_check.verdict(0, "hello world", "hello") == "ok"
    assert docs_check.verdict(3, "hello world", "hello") == "FAILED (exit 3)"
    assert docs_check.verdict(0, "bye", "hello") == "FAILED (output lacks 'hello')"


def test_a_failing_block_fails_the_file(docs_check: ModuleType, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(DOC)
    assert docs_check.check_file(page) == 0
    page.write_text(DOC.replace("echo hello world", "echo bye"))
    assert docs_check.check_file(page) == 1
    page.write_text(DOC.replace("echo first", "false"))
    assert docs_check.check_file(page) == 1


def test_background_processes_of_a_block_are_killed(docs_check: ModuleType, tmp_path: Path) -> None:
    code, out, _ = docs_check.run_block("sleep 300 > /dev/null 2>&1 &\necho $!", str(tmp_path))
    assert code == 0
    pid = int(out.strip())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the block's background process outlived it"
        time.sleep(0.1)


def test_blocks_run_the_docs_venv_commands_as_written(docs_check: ModuleType, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    block = "test -x .venv/bin/python && command -v optimum-cli"
    page.write_text(f'<!-- docs-check expect=".venv/bin/optimum-cli" -->\n```bash\n{block}\n```\n')
    assert docs_check.check_file(page) == 0


def test_files_run_side_by_side(docs_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two files whose blocks each wait (up to 20 s) for the other's mark: both pass only when they run at once."""

    def page(name: str, mine: str, theirs: str) -> Path:
        wait = f"for i in $(seq 200); do [ -f {tmp_path}/{theirs} ] && break; sleep 0.1; done"
        block = f"touch {tmp_path}/{mine}\n{wait}\ntest -f {tmp_path}/{theirs} && echo met"
        path = tmp_path / name
        path.write_text(f'<!-- docs-check expect="met" -->\n```bash\n{block}\n```\n')
        return path

    assert docs_check.JOBS >= 2
    assert docs_check.main([str(page("a.md", "a", "b")), str(page("b.md", "b", "a"))]) == 0
    assert "2 runnable blocks, 0 failed" in capsys.readouterr().out
