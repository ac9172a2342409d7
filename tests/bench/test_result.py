"""Formatting, result files and the terminal table."""

from __future__ import annotations

import json

from rich.console import Console

from gpulab.bench.harness import Timing
from gpulab.bench.result import Column, Result, fmt_bytes, fmt_seconds, fmt_time, json_of, render


def _timing(median=1e-3):
    return Timing(median_s=median, iqr_s=median / 10, min_s=median * 0.9, max_s=median * 1.2, repeats=5, inner=1, clock="cpu")


def test_formats():
    assert fmt_seconds(2.5) == "2.5 s"
    assert fmt_seconds(0.0015) == "1.5 ms"
    assert fmt_seconds(3e-6) == "3 µs"
    assert fmt_seconds(5e-9) == "5 ns"
    assert fmt_bytes(1024) == "1 KiB"
    assert fmt_bytes(256 * 2**20) == "256 MiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_time(_timing().to_dict()) == "1 ms ±5%"


def test_column_reads_nested_keys():
    row = {"time": _timing().to_dict(), "n": 1024, "gone": None}
    assert Column("time.median_s", "m", "seconds").cell(row) == "1 ms"
    assert Column("n", "n", "int").cell(row) == "1,024"
    assert Column("missing", "x", "num").cell(row) == "-"
    assert Column("gone", "g", "ratio").cell(row) == "-"


def _result():
    r = Result(name="demo", lesson="a lesson", config={"n": 1}, env={"torch": "x"}, preset="tiny")
    t = r.table("main", "demo table", [Column("n", "n", "int"), Column("time", "time", "time")])
    t.add(n=1, time=_timing())
    r.check("equal", [1.0], [1.0])
    r.skip("GPU rows", "no GPU")
    r.note("a note")
    r.summary = {"headline": "it works", "value": float("inf")}
    return r


def test_result_json_shape():
    data = json.loads(json_of(_result()))  # inf became null: the file stays valid JSON
    assert data["benchmark"] == "demo" and data["status"] == "ok" and data["preset"] == "tiny"
    assert data["summary"] == {"headline": "it works", "value": None}
    assert data["tables"]["main"]["rows"][0]["time"]["median_s"] == 1e-3
    assert data["tables"]["main"]["columns"] == ["n", "time"]
    assert data["checks"][0]["passed"] is True
    assert data["skipped"] == [{"what": "GPU rows", "why": "no GPU"}]


def test_render_prints_tables_skips_and_notes():
    console = Console(record=True, width=120)
    render(_result(), console)
    text = console.export_text()
    for expected in ("demo table", "1 ms ±5%", "checked 1 comparison:", "skipped GPU rows: no GPU", "note a note", "it works"):
        assert expected in text
