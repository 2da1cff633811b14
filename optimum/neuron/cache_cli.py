"""The ``optimum-cli neuron cache list | clear | prune`` commands over `cache_admin`: their arguments and what they
print. The same commands run as ``python -m optimum.neuron.cache_cli list | clear | prune``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .cache_admin import (
    ARTIFACT_FIELDS,
    SCRATCH,
    CacheState,
    Entry,
    Report,
    clear,
    folder_bytes,
    format_size,
    parse_size,
    prune,
    scan,
    total_bytes,
)
from .cache_dir import cache_root
from .errors import CacheError

LIST_HELP = "Show the cached artifacts and compiled graphs, their size and last use."
CLEAR_HELP = "Remove every cached artifact and compiled graph (--all: inductor's and the kernels' caches too)."
_HEADERS = ("batch", "seq", "chunk", "dtype", "backend")
"""The artifacts table's headers of `ARTIFACT_FIELDS` (backend and device in one column)."""
PRUNE_HELP = "Remove the least recently used artifacts and compiled graphs until the cache fits --max-size."


def add_list_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``cache list``."""
    parser.add_argument("--json", action="store_true", help="print the listing as JSON (sizes in bytes)")


def add_clear_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``cache clear``."""
    parser.add_argument(
        "--all",
        action="store_true",
        help=f"also remove the scratch caches ({', '.join(SCRATCH)}/): run it while no export runs",
    )


def add_prune_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``cache prune``."""
    parser.add_argument(
        "--max-size",
        "--max_size",
        dest="max_size",
        required=True,
        type=_size_argument,
        metavar="SIZE",
        help="the most the artifacts and graphs may take: bytes, or K, M, G, T (powers of 1024), e.g. 2G, 500M, 1.5GB",
    )
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true", help="only list what would go")


def _size_argument(text: str) -> int:
    """`cache_admin.parse_size` for argparse: a bad value exits with status 2, naming the flag."""
    try:
        return parse_size(text)
    except CacheError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def run_list(args: argparse.Namespace) -> int:
    """Print the cache's location, its artifacts and graphs (tables, or JSON with ``--json``) and its totals."""
    state = scan()
    body = listing(state)
    if args.json:
        print(json.dumps(body, indent=1))
        return 0
    _print_tables(body)
    return 0


def run_clear(args: argparse.Namespace) -> int:
    """Remove the cached artifacts and graphs (and with ``--all`` the scratch caches); print what was freed."""
    root = cache_root()
    report = clear(root, everything=args.all)
    _print_report(root, report, dry_run=False)
    print(f"freed {format_size(report.freed)} in {root}")
    return 0


def run_prune(args: argparse.Namespace) -> int:
    """Remove least recently used entries until the cache takes at most ``--max-size``; print what went."""
    root = cache_root()
    report = prune(args.max_size, root, dry_run=args.dry_run)
    _print_report(root, report, dry_run=args.dry_run)
    verb = "would free" if args.dry_run else "freed"
    print(
        f"{verb} {format_size(report.freed)}; artifacts and graphs take {format_size(report.total_after)} "
        f"(--max-size {format_size(args.max_size)}) in {root}"
    )
    if report.total_after > args.max_size:
        print("still above --max-size: the entries kept are in use by running exports", file=sys.stderr)
    return 0


def listing(state: CacheState) -> dict[str, Any]:
    """The JSON-ready view of ``state`` that ``list`` prints: artifacts and graphs (most recently used first), the
    folders being built and the totals in bytes (a file hard-linked by several entries counted once)."""
    return {
        "root": str(state.root),
        "artifacts": [_artifact_row(entry) for entry in _recent_first(state.artifacts)],
        "graphs": [_graph_row(entry, state.references(entry.key)) for entry in _recent_first(state.graphs)],
        "staging": [{"path": str(s.path), "pid": s.pid, "size": s.size} for s in state.staging],
        "totals": {
            "artifacts": total_bytes(state.artifacts),
            "graphs": total_bytes(state.graphs),
            "total": total_bytes(state.entries),
            "staging": sum(s.size for s in state.staging),
            **{name: folder_bytes(state.root / name) for name in SCRATCH},
        },
    }


def _recent_first(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda entry: (-entry.last_use, entry.key))


def _artifact_row(entry: Entry) -> dict[str, Any]:
    return {"key": entry.key, "path": str(entry.path), **entry.info, "size": entry.size, "last_use": entry.last_use}


def _graph_row(entry: Entry, references: list[str]) -> dict[str, Any]:
    row = {"key": entry.key, "path": str(entry.path), **entry.info, "size": entry.size, "last_use": entry.last_use}
    return {**row, "artifacts": len(references), "referenced_by": references}


def _when(epoch: float) -> str:
    return time.strftime("%m-%d %H:%M", time.localtime(epoch))


def _print_tables(body: dict[str, Any]) -> None:
    """The listing as two rich tables and a totals line. The tables keep their natural width (a narrow terminal wraps
    their lines): a key or a graph name is never cut or folded, so that it can be copied."""
    from rich.console import Console

    console = Console()
    console.print(f"compile cache: {body['root']}")
    artifacts = _table("artifacts (exports/)", "key", "model", *_HEADERS, "graphs", "size", "last use")
    for row in body["artifacts"]:
        artifacts.add_row(*_artifact_cells(row))
    graphs = _table("compiled graphs (graphs/)", "key", "graph", "model", "backend", "size", "compile", "last use")
    graphs.add_column("used by")
    for row in body["graphs"]:
        graphs.add_row(*_graph_cells(row))
    for table in (artifacts, graphs):
        width = max(console.width, console.measure(table, options=console.options.update_width(1000)).maximum)
        Console(width=width, force_terminal=console.is_terminal).print(table)
    totals = body["totals"]
    scratch = ", ".join(f"{name}/ {format_size(totals[name])}" for name in SCRATCH)
    console.print(
        f"{len(body['artifacts'])} artifacts, {len(body['graphs'])} graphs: {format_size(totals['total'])} "
        f"(hard-linked graph files counted once); being built or left by killed exports: "
        f"{format_size(totals['staging'])}; scratch: {scratch}"
    )


def _table(title: str, *headers: str) -> Any:
    """A compact table with the columns ``headers``."""
    from rich import box
    from rich.table import Table

    table = Table(*headers, title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left")
    return table


def _artifact_cells(row: dict[str, Any]) -> list[str]:
    fields = [str(row[name]) for name in ARTIFACT_FIELDS if name not in ("backend", "device")]
    backend = f"{row['backend']}/{row['device']}"
    graphs = "\n".join(row["graphs"])
    return [
        row["key"],
        str(row["model_type"]),
        *fields,
        backend,
        graphs,
        format_size(row["size"]),
        _when(row["last_use"]),
    ]


def _graph_cells(row: dict[str, Any]) -> list[str]:
    seconds = "?" if row["compile_seconds"] is None else f"{row['compile_seconds']:.1f} s"
    backend = f"{row['backend']}/{row['device']}"
    size, when = format_size(row["size"]), _when(row["last_use"])
    return [row["key"], str(row["graph"]), str(row["model"]), backend, size, seconds, when, str(row["artifacts"])]


def _print_report(root: Path, report: Report, dry_run: bool) -> None:
    """One line per folder removed (or, dry, that would be) and per folder kept, paths relative to ``root``."""
    verb = "would remove" if dry_run else "removed"
    for path, size in report.removed:
        print(f"{verb} {path.relative_to(root)} ({format_size(size)})")
    for path, why in report.kept:
        print(f"kept {path.relative_to(root)}: {why}")


def main(argv: list[str] | None = None) -> int:
    """``python -m optimum.neuron.cache_cli list | clear | prune``: the ``optimum-cli neuron cache`` commands."""
    parser = argparse.ArgumentParser(prog="python -m optimum.neuron.cache_cli", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_, add, run in (
        ("list", LIST_HELP, add_list_arguments, run_list),
        ("clear", CLEAR_HELP, add_clear_arguments, run_clear),
        ("prune", PRUNE_HELP, add_prune_arguments, run_prune),
    ):
        command = commands.add_parser(name, help=help_, description=help_)
        add(command)
        command.set_defaults(run=run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
