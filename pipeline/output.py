"""Printing query results: a table for people, CSV and JSON for programs."""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import json
import sys

import pyarrow as pa

TABLE_MAX_ROWS = 1000


def _plain(v):
    """A JSON-friendly value: lists and maps stay structured, times become ISO text."""
    if isinstance(v, (dt.datetime, dt.date)):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def _cell(v, max_width: int) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        text = f"{v:.6g}"
    elif isinstance(v, (list, dict, tuple)):
        text = json.dumps(_plain(v))
    else:
        text = str(_plain(v))
    return text if len(text) <= max_width else text[: max_width - 3] + "..."


def print_table(table: pa.Table, fmt: str, max_width: int = 60, out=None) -> None:
    out = out or sys.stdout
    rows = table.to_pylist()
    if fmt == "json":
        json.dump([{k: _plain(v) for k, v in r.items()} for r in rows], out, indent=1)
        out.write("\n")
        return
    if fmt == "csv":
        w = csv.writer(out)
        w.writerow(table.column_names)
        for r in rows:
            w.writerow(["" if v is None else json.dumps(_plain(v)) if isinstance(v, (list, dict, tuple))
                        else _plain(v) for v in r.values()])
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(show_lines=False, header_style="bold")
    for name in table.column_names:
        t.add_column(name, overflow="fold")
    for r in rows[:TABLE_MAX_ROWS]:
        t.add_row(*(_cell(v, max_width) for v in r.values()))
    console = Console(file=out, width=max(120, Console().width))
    console.print(t)
    more = f", showing {TABLE_MAX_ROWS} (use --format csv for all)" if len(rows) > TABLE_MAX_ROWS else ""
    console.print(f"({len(rows)} row{'s' if len(rows) != 1 else ''}{more})")
