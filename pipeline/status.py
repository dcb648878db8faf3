"""`asyncgrpo status`: what is in a buffer, per state and per version."""

from __future__ import annotations

import os

import pyarrow.parquet as pq

from buffer.index import GroupIndex
from buffer.layout import BufferDir, find_buffer


def _default_trainer_version(d: BufferDir, index: GroupIndex) -> int:
    """The newest trainer version in the ledger, else the newest group version, else 0."""
    ledger = d.ledger_shards()
    if ledger:
        return int(max(pq.read_table(ledger[-1], columns=["trainer_version"]).column(0).to_pylist()))
    return int(index.version.view.max()) if len(index) else 0


def buffer_status(path: str | os.PathLike, *, trainer_version: int | None = None,
                  max_staleness: int | None = None, reuse: int = 1) -> dict:
    root = find_buffer(path)
    d = BufferDir(root)
    index = GroupIndex(root, quarantine=False)
    t = _default_trainer_version(d, index) if trainer_version is None else trainer_version
    counts = index.counts(t, max_staleness, reuse)
    shards = d.live_shards()
    ledger = d.ledger_shards()

    def size(paths):
        total = 0
        for p in paths:
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    return {
        "buffer": str(root),
        "trainer_version": t,
        "max_staleness": max_staleness,
        "reuse": reuse,
        **counts,
        "completions": int(index.group_size.view.sum()),
        "files": {"shards": len(shards), "shard_bytes": size(shards),
                  "ledger": len(ledger), "ledger_bytes": size(ledger),
                  "quarantined": len(d.quarantined()), "unreadable_now": len(index.unreadable)},
        "unreadable": index.unreadable,
        "quarantined": d.quarantined(),
    }


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def print_status(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    limit = "unlimited" if r["max_staleness"] is None else r["max_staleness"]
    c.print(f"[bold]{r['buffer']}[/bold]  trainer version {r['trainer_version']}, "
            f"max staleness {limit}, reuse {r['reuse']}")
    f = r["files"]
    c.print(f"{r['groups']} groups, {r['completions']} completions in {f['shards']} shards "
            f"({_human_bytes(f['shard_bytes'])}); ledger {f['ledger']} files "
            f"({_human_bytes(f['ledger_bytes'])}); quarantined {f['quarantined']}")
    states = ("eligible", "consumed", "filtered", "expired", "future", "unavailable")
    t = Table("state", "groups", title="groups per state")
    for s in states:
        t.add_row(s, str(r[s]))
    for reason, n in r["filtered_by_reason"].items():
        t.add_row(f"  filtered: {reason}", str(n))
    c.print(t)
    if r["by_version"]:
        t = Table("version", *states, title="groups per version")
        for v, row in sorted(r["by_version"].items()):
            t.add_row(str(v), *(str(row.get(s, 0)) for s in states))
        c.print(t)
    for name, reason in r["unreadable"].items():
        c.print(f"[red]unreadable[/red] {name}: {reason}")
    for q in r["quarantined"]:
        c.print(f"[yellow]quarantined[/yellow] {q.get('file')}: {q.get('reason')}")
