"""`asyncgrpo sql` prints every DuckDB type exactly, in each format (pipeline/output.py)."""

import csv
import io
import json
from decimal import Decimal

import duckdb
import pytest

from buffer import ShardWriter
from conftest import make_group, run_cli
from pipeline import output
from pipeline.output import print_table

HUGE = 170141183460469231731687303715884105727           # HUGEINT max, past 2^63 and 2^64
UHUGE = 340282366920938463463374607431768211455          # UHUGEINT max
BLOB_BYTES = bytes([0xFF, 0x00]) + b"a\\b,"              # not UTF-8, a backslash, a comma

# (column, SQL expression, DuckDB's text of it (table and csv), its value parsed back from our JSON)
CASES = [
    ("b", "true", "true", True),
    ("i1", "(-128)::TINYINT", "-128", -128),
    ("i2", "32767::SMALLINT", "32767", 32767),
    ("i4", "(-2147483648)::INTEGER", "-2147483648", -2147483648),
    ("i8", "9223372036854775807::BIGINT", "9223372036854775807", 9223372036854775807),
    ("u1", "255::UTINYINT", "255", 255),
    ("u2", "65535::USMALLINT", "65535", 65535),
    ("u4", "4294967295::UINTEGER", "4294967295", 4294967295),
    ("u8", "18446744073709551615::UBIGINT", "18446744073709551615", 18446744073709551615),
    ("h", f"{HUGE}::HUGEINT", str(HUGE), HUGE),
    ("h_neg", f"(-{HUGE} - 1)::HUGEINT", str(-HUGE - 1), -HUGE - 1),
    ("uh", f"{UHUGE}::UHUGEINT", str(UHUGE), UHUGE),
    ("dec", "12345678901234567890.123456789012345678::DECIMAL(38,18)",
     "12345678901234567890.123456789012345678", Decimal("12345678901234567890.123456789012345678")),
    ("dec_small", "1.10::DECIMAL(5,2)", "1.10", Decimal("1.1")),
    ("f", "0.5::FLOAT", "0.5", Decimal("0.5")),
    ("d", "0.1::DOUBLE", "0.1", Decimal("0.1")),
    ("d_third", "1/3", "0.3333333333333333", Decimal("0.3333333333333333")),
    ("d_nan", "'nan'::DOUBLE", "nan", "NaN"),
    ("d_inf", "'inf'::DOUBLE", "inf", "Infinity"),
    ("f_neg_inf", "'-inf'::FLOAT", "-inf", "-Infinity"),
    ("dt", "DATE '2024-02-29'", "2024-02-29", "2024-02-29"),
    ("t", "TIME '12:34:56.789'", "12:34:56.789", "12:34:56.789"),
    ("ttz", "TIMETZ '12:00:00+02'", "12:00:00+02", "12:00:00+02"),
    ("ts", "TIMESTAMP '2024-01-02 03:04:05.123456'", "2024-01-02 03:04:05.123456", "2024-01-02 03:04:05.123456"),
    ("tstz", "TIMESTAMPTZ '2024-01-02 03:04:05.123456+00'", "2024-01-02 03:04:05.123456+00",
     "2024-01-02 03:04:05.123456+00"),
    ("ts_s", "'2024-01-02 03:04:05'::TIMESTAMP_S", "2024-01-02 03:04:05", "2024-01-02 03:04:05"),
    ("ts_ms", "'2024-01-02 03:04:05.123'::TIMESTAMP_MS", "2024-01-02 03:04:05.123", "2024-01-02 03:04:05.123"),
    ("ts_ns", "'2024-01-02 03:04:05.123456789'::TIMESTAMP_NS", "2024-01-02 03:04:05.123456789",
     "2024-01-02 03:04:05.123456789"),
    ("iv", "INTERVAL '1 year 2 months 3 days 04:05:06.789'", "1 year 2 months 3 days 04:05:06.789",
     "1 year 2 months 3 days 04:05:06.789"),
    ("s", "'héllo, \"wörld\" [b]x[/b]' || chr(10) || 'line2 ✓'", 'héllo, "wörld" [b]x[/b]\nline2 ✓',
     'héllo, "wörld" [b]x[/b]\nline2 ✓'),
    ("empty", "''", "", ""),
    ("bl", f"from_hex('{BLOB_BYTES.hex()}')", "\\xFF\\x00a\\x5Cb,", "\\xFF\\x00a\\x5Cb,"),
    ("u", "'123e4567-e89b-12d3-a456-426614174000'::UUID", "123e4567-e89b-12d3-a456-426614174000",
     "123e4567-e89b-12d3-a456-426614174000"),
    ("en", "'b'::ENUM('a', 'b')", "b", "b"),
    ("l", "[1, 2, NULL]", "[1, 2, NULL]", [1, 2, None]),
    ("ll", "[[1, 2], [3]]", "[[1, 2], [3]]", [[1, 2], [3]]),
    ("arr", "[1.5, 2.5]::DOUBLE[2]", "[1.5, 2.5]", [Decimal("1.5"), Decimal("2.5")]),
    ("st", "{'x': 1, 'y': 'a,b', 'z': [1]}", "{'x': 1, 'y': 'a,b', 'z': [1]}", {"x": 1, "y": "a,b", "z": [1]}),
    ("m", "MAP {'k1': 1, 'k2': 2}", "{k1=1, k2=2}", {"k1": 1, "k2": 2}),
    ("m_int", "MAP {1: 'a'}", "{1=a}", {"1": "a"}),
    ("un", "union_value(num := 2)::UNION(num INTEGER, str VARCHAR)", "2", {"num": 2}),
    ("bt", "'10101'::BIT", "10101", "10101"),
    ("js", "'{\"a\": [1, 2.5, null]}'::JSON", '{"a": [1, 2.5, null]}', {"a": [1, Decimal("2.5"), None]}),
    ("n", "NULL", None, None),
    ("l_huge", f"[{HUGE}::HUGEINT]", f"[{HUGE}]", [HUGE]),
    ("l_nan", "['nan'::DOUBLE, 1.0]", "[nan, 1.0]", ["NaN", Decimal("1.0")]),
]
NAMES = [c[0] for c in CASES]
# Row 1 holds the values, row 2 a NULL of each type.
ALL_TYPES = ("SELECT * FROM (SELECT 1 AS k, " + ", ".join(f"{e} AS {n}" for n, e, _, _ in CASES)
             + " UNION ALL SELECT 2, " + ", ".join("NULL" for _ in CASES) + ") ORDER BY k")


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    buf = tmp_path_factory.mktemp("sql_output") / "buffer"
    with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:
        for i in range(3):
            w.append(make_group(i, [1, 0], prompt_id=f"p{i}"))
    return buf


@pytest.fixture
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")  # TIMESTAMPTZ prints in the session's time zone


def _sql(buffer, *args):
    r = run_cli("sql", str(buffer), *args)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return r.stdout


def test_json_keeps_every_value(buffer, utc):
    text = _sql(buffer, "--format", "json", ALL_TYPES)
    values, nulls = json.loads(text, parse_float=Decimal)   # Decimal: to see every digit that was written
    assert list(values) == ["k", *NAMES]
    assert {n: values[n] for n in NAMES} == {n: v for n, _, _, v in CASES}
    assert str(HUGE) in text and f"-{HUGE + 1}" in text and str(UHUGE) in text
    assert all(nulls[n] is None for n in NAMES)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))  # strict: no NaN tokens
    assert _blob(values["bl"]) == BLOB_BYTES


def test_csv_keeps_every_value(buffer, utc):
    text = _sql(buffer, "--format", "csv", ALL_TYPES)
    assert "\r" not in text and text.endswith("\n")
    header, values, nulls = list(csv.reader(io.StringIO(text, newline="")))
    assert header == ["k", *NAMES]
    assert dict(zip(header, values)) == {"k": "1", **{n: t or "" for n, _, t, _ in CASES}}
    assert nulls == ["2"] + [""] * len(CASES)
    # an empty string is "" and NULL an empty field, so the two stay apart
    assert ',"",' in text and text.endswith("\n2" + "," * len(CASES) + "\n")
    assert _blob(dict(zip(header, values))["bl"]) == BLOB_BYTES


def test_table_shows_every_value(buffer, utc, monkeypatch):
    monkeypatch.setenv("COLUMNS", "4000")  # wide enough that no cell wraps
    text = _sql(buffer, "--max-width", "100", ALL_TYPES.replace("ORDER BY k", "WHERE k = 1"))
    lines = text.splitlines()
    header = [c.strip() for c in lines[1].split("┃")[1:-1]]
    body = [line.split("│")[1:-1] for line in lines[3:lines.index(next(x for x in lines if x.startswith("└")))]]
    cells = ["\n".join(line[i].strip() for line in body).strip() for i in range(len(header))]
    assert header == ["k", *NAMES]
    assert dict(zip(header, cells)) == {"k": "1", **{n: "NULL" if t is None else t for n, _, t, _ in CASES}}
    assert lines[-1] == "(1 row)"


def _blob(text: str) -> bytes:
    """DuckDB's text of a blob, read back by DuckDB."""
    return duckdb.connect().execute("SELECT CAST(? AS BLOB)", [text]).fetchall()[0][0]


# In-process: the printer over a plain DuckDB relation.

def _print(sql: str, fmt: str, max_width: int = 60) -> str:
    con = duckdb.connect()
    out = io.StringIO()
    print_table(con.sql(sql).materialize(), fmt, max_width, out=out)
    con.close()
    return out.getvalue()


def test_non_finite_floats_are_json_strings_but_strings_are_untouched():
    text = _print("SELECT 'nan'::DOUBLE AS \"NaN\", 'Infinity, -Infinity and NaN \" NaN' AS s, 'a\\' AS backslash, "
                  "{'a': '-inf'::DOUBLE, 'b': ['inf'::FLOAT]} AS st", "json")
    assert json.loads(text) == [{"NaN": "NaN", "s": 'Infinity, -Infinity and NaN " NaN', "backslash": "a\\",
                                 "st": {"a": "-Infinity", "b": ["Infinity"]}}]
    assert output.NON_FINITE_JSON == ("NaN", "Infinity", "-Infinity")


def test_help_states_the_json_choices():
    r = run_cli("sql", "--help")
    assert r.returncode == 0 and "every digit" in r.stdout
    assert all(f'"{token}"' in r.stdout for token in output.NON_FINITE_JSON)


def test_json_of_no_rows_and_duplicate_names():
    assert json.loads(_print("SELECT 1 AS a WHERE false", "json")) == []
    assert json.loads(_print("SELECT 1 AS a, 2 AS a", "json")) == [{"a": 1, "a_1": 2}]


def test_csv_quotes_only_where_needed():
    text = _print("SELECT 1 AS \"a,b\", 'x' AS s, 'y\"z' AS q, 'p' || chr(10) || 'q' AS nl, 2.5 AS d", "csv")
    assert text == '"a,b",s,q,nl,d\n1,x,"y""z","p\nq",2.5\n'


def test_table_cuts_long_cells_caps_rows_and_reads_no_markup(monkeypatch):
    text = _print("SELECT repeat('x', 30) AS long, '[b]x[/i]' AS markup, NULL AS n", "table", max_width=10)
    assert "xxxxxxx..." in text and "x" * 11 not in text
    assert "[b]x[/i]" in text and "NULL" in text and "(1 row)" in text
    monkeypatch.setattr(output, "TABLE_MAX_ROWS", 3)
    text = _print("SELECT range AS i FROM range(5)", "table")
    assert "(5 rows, showing 3 (use --format csv for all))" in text
    assert "│ 2 │" in text and "│ 3 │" not in text


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="'xml'"):
        _print("SELECT 1", "xml")
