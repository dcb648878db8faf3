"""Printing query results: a table for people, CSV and JSON for programs.

DuckDB renders every value, so each of its types prints exactly (no Python
conversion in between):

- table: DuckDB's text for the value (`CAST(v AS VARCHAR)`), drawn by rich.
  Cells longer than `max_width` are cut with '...', at most TABLE_MAX_ROWS
  rows are drawn and a note says how many there were; NULL shows as a dim NULL.
- csv: DuckDB's CSV writer over that same text: a header line, lines ending
  in "\\n", quotes only where needed. NULL is an empty field, an empty string
  is `""`. Nested values are DuckDB's text (`[1, 2]`, `{'x': 1}`, `{k=1}`),
  a blob is its bytes with the non-printable ones (and backslash) as `\\xNN`.
- json: a JSON array of one object per row, one row a line, each written by
  DuckDB's `to_json`. Integers and decimals keep every digit as JSON numbers
  (HUGEINT and DECIMAL(38, s) too: parse them with a reader that keeps big
  numbers, e.g. Python's json with `parse_float=decimal.Decimal`); lists and
  arrays are arrays, structs and maps are objects (map keys as text), a union
  is `{"tag": value}`, a JSON column is embedded as JSON; dates, times,
  timestamps, intervals, UUIDs, bits and blobs are DuckDB's text, as in csv.
  JSON has no NaN or infinity, so those floats are the strings "NaN",
  "Infinity" and "-Infinity" (NON_FINITE_JSON).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

import buffer

if TYPE_CHECKING:
    import duckdb

TABLE_MAX_ROWS = 1000

# DuckDB's to_json writes non-finite floats as these bare tokens, which JSON lacks; they become strings.
NON_FINITE_JSON = ("NaN", "Infinity", "-Infinity")
# A JSON string (left as it is) or one of those tokens outside a string (to be quoted).
_JSON_STRING_OR_NON_FINITE = re.compile(r'("(?:[^"\\]|\\.)*")|('
                                        + "|".join(sorted(map(re.escape, NON_FINITE_JSON), key=len, reverse=True))
                                        + ")")

# Right-aligned in the table.
_NUMERIC_TYPES = {"tinyint", "smallint", "integer", "bigint", "hugeint", "utinyint", "usmallint", "uinteger",
                  "ubigint", "uhugeint", "decimal", "float", "double"}

_UNBOUNDED_WIDTH = 1_000_000  # to measure a table's own width, not the terminal's
_BATCH_ROWS = 10_000


def print_table(result: duckdb.DuckDBPyRelation, fmt: str, max_width: int = 60, out=None) -> None:
    """Print the rows of `result` as fmt: "table", "csv" or "json" (see the module doc).

    `result` should hold rows already read (BufferSQL.result gives one): each
    format reads it again.
    """
    out = out or sys.stdout
    if fmt == "table":
        _print_rich_table(result, max_width, out)
    elif fmt == "csv":
        _print_csv(result, out)
    elif fmt == "json":
        _print_json(result, out)
    else:
        raise ValueError(f"unknown output format {fmt!r}; use table, csv or json")


def _as_text(result: duckdb.DuckDBPyRelation) -> duckdb.DuckDBPyRelation:
    """Every column cast to VARCHAR by DuckDB: its own text for each type; NULL stays NULL."""
    return result.query("result", "SELECT COLUMNS(*)::VARCHAR FROM result")


def _print_rich_table(result: duckdb.DuckDBPyRelation, max_width: int, out) -> None:
    """Cells wrap to fit the terminal; a table too wide to fit with each column as wide as its
    longest word is drawn wider than the terminal, so no column is cropped or squeezed to nothing."""
    total = len(result)
    shown = _as_text(result.limit(TABLE_MAX_ROWS))
    t = Table(show_lines=False, header_style="bold")
    for name, typ in zip(shown.columns, result.types):
        t.add_column(Text(name), overflow="fold", justify="right" if typ.id in _NUMERIC_TYPES else "left")
    for row in shown.fetchall():
        t.add_row(*(_cell(v, max_width) for v in row))
    console = Console(file=out, width=max(120, Console().width))
    narrowest = Measurement.get(console, console.options.update_width(_UNBOUNDED_WIDTH), t).minimum
    console = Console(file=out, width=max(console.width, narrowest))
    console.print(t)
    more = f", showing {TABLE_MAX_ROWS} (use --format csv for all)" if total > TABLE_MAX_ROWS else ""
    console.print(Text(f"({total} row{'s' if total != 1 else ''}{more})"))


def _cell(text: str | None, max_width: int) -> Text:
    """A table cell: Text, so brackets in the data are never read as rich markup."""
    if text is None:
        return Text("NULL", style="dim")
    return Text(text if len(text) <= max_width else text[: max_width - 3] + "...")


def _print_csv(result: duckdb.DuckDBPyRelation, out) -> None:
    """DuckDB's CSV writer over DuckDB's text of each value.

    The query's connection may not write files (BufferSQL locks it), so the
    text goes through Arrow (strings, nothing to lose) to a fresh connection
    that writes a temporary file, which is then copied to `out`.
    """
    writer = buffer.offline_connection()
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-csv-") as tmp:
        path = Path(tmp) / "result.csv"
        try:
            writer.from_arrow(_as_text(result).to_arrow_reader()).write_csv(str(path), header=True)
        finally:
            writer.close()
        with path.open(encoding="utf-8", newline="") as f:
            shutil.copyfileobj(f, out)


def _print_json(result: duckdb.DuckDBPyRelation, out) -> None:
    rows = result.query("result", "SELECT to_json(struct_pack(*COLUMNS(*))) AS line FROM result")
    first = True
    out.write("[")
    for batch in rows.to_arrow_reader(_BATCH_ROWS):
        for row in batch.column(0).to_pylist():
            out.write("\n" if first else ",\n")
            out.write(_finite_json(row))
            first = False
    out.write("\n]\n" if not first else "]\n")


def _finite_json(text: str) -> str:
    """DuckDB's JSON text with its NaN/Infinity/-Infinity tokens (outside strings) made strings."""
    if not any(token in text for token in NON_FINITE_JSON):
        return text
    return _JSON_STRING_OR_NON_FINITE.sub(lambda m: m.group(1) or f'"{m.group(2)}"', text)
