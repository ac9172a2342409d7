"""What a benchmark produces: tables of rows, the checks it passed, what it skipped and why.

A `Result` is plain data: it becomes `DIR/<name>.json` as is, a rich table on the terminal
(`render`), and the input of the benchmark's own plot. Rows keep raw numbers (seconds, bytes,
GB/s) and whole `Timing` dicts; only the terminal formats them.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from gpulab.bench.harness import Check, ResultMismatch, Timing, check_close
from gpulab.io import json_bytes

# ----------------------------------------------------------------------------- formatting


def fmt_seconds(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def fmt_time(t: dict | None) -> str:
    """A Timing dict as 'median ±half-IQR%' (the spread relative to the median)."""
    if not t:
        return "-"
    rel = t["iqr_s"] / t["median_s"] if t["median_s"] > 0 else 0.0
    return f"{fmt_seconds(t['median_s'])} ±{50 * rel:.0f}%"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_number(x: float | None, spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


FORMATS: dict[str, Callable[[Any], str]] = {
    "text": lambda v: "-" if v is None else str(v),
    "time": fmt_time,
    "seconds": fmt_seconds,
    "bytes": fmt_bytes,
    "ratio": lambda v: "-" if v is None else f"{v:.2f}x",
    "pct": lambda v: "-" if v is None else f"{100 * v:.0f}%",
    "int": lambda v: "-" if v is None else f"{v:,}",
    "num": fmt_number,
    "rate": lambda v: fmt_number(v, ",.0f") if v is not None and v >= 100 else fmt_number(v, ".3g"),
}


# ----------------------------------------------------------------------------- tables


@dataclass
class Column:
    key: str
    """Key of the row dict (dotted for nested values, e.g. 'time.median_s')."""
    header: str
    fmt: str = "text"
    """One of FORMATS."""

    def cell(self, row: dict) -> str:
        value: Any = row
        for part in self.key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return FORMATS[self.fmt](value)


@dataclass
class Table:
    title: str
    columns: list[Column]
    rows: list[dict] = field(default_factory=list)

    def add(self, **row) -> dict:
        row = {k: v.to_dict() if isinstance(v, Timing) else v for k, v in row.items()}
        self.rows.append(row)
        return row

    def to_dict(self) -> dict:
        return {"title": self.title, "columns": [c.key for c in self.columns], "rows": self.rows}


# ----------------------------------------------------------------------------- results


@dataclass
class Result:
    name: str
    lesson: str
    config: dict
    env: dict
    preset: str
    command: str | None = None
    tables: dict[str, Table] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    """The key figures, for docs and the `all` summary; 'headline' is one line of text."""
    status: str = "ok"
    error: str | None = None
    wall_s: float | None = None
    other_load_pct: float | None = None
    """Share of the CPU other processes used meanwhile (see environment.OtherLoad)."""

    def table(self, key: str, title: str, columns: list[Column]) -> Table:
        self.tables[key] = Table(title, columns)
        return self.tables[key]

    def check(self, what: str, actual, expected, **tolerance) -> Check:
        """`check_close`, recorded; raises `ResultMismatch` (and the run stops) if it fails."""
        try:
            check = check_close(what, actual, expected, **tolerance)
        except ResultMismatch as e:
            if e.check is not None:
                self.checks.append(e.check)
            raise
        self.checks.append(check)
        return check

    def skip(self, what: str, why: str) -> None:
        self.skipped.append({"what": what, "why": why})

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def to_dict(self) -> dict:
        return {
            "benchmark": self.name,
            "lesson": self.lesson,
            "status": self.status,
            "error": self.error,
            "preset": self.preset,
            "command": self.command,
            "wall_s": self.wall_s,
            "other_load_pct": self.other_load_pct,
            "summary": self.summary,
            "env": self.env,
            "config": self.config,
            "tables": {k: t.to_dict() for k, t in self.tables.items()},
            "checks": [c.to_dict() for c in self.checks],
            "skipped": self.skipped,
            "notes": self.notes,
        }


def render(result: Result, console: Console) -> None:
    """The terminal view: every table, then checks, skips and notes, one line each."""
    for table in result.tables.values():
        if not table.rows:
            continue
        # The title on its own line: as a rich table title it would wrap to the table's width.
        console.print(f"[bold]{escape(table.title)}[/]")
        rich_table = RichTable(header_style="bold")
        for c in table.columns:
            rich_table.add_column(escape(c.header), justify="left" if c.fmt == "text" else "right")
        for row in table.rows:
            rich_table.add_row(*(escape(c.cell(row)) for c in table.columns))
        console.print(rich_table)
    passed = sum(c.passed for c in result.checks)
    if passed:
        console.print(f"[green]checked[/] {passed} comparison{'s' if passed != 1 else ''}: equal results before timing")
    for s in result.skipped:
        console.print(f"[yellow]skipped[/] {escape(s['what'])}: {escape(s['why'])}")
    for n in result.notes:
        console.print(f"[cyan]note[/] {escape(n)}")
    if result.summary.get("headline"):
        console.print(f"[bold]=> {escape(result.summary['headline'])}[/]")


# ----------------------------------------------------------------------------- files


def json_of(result: Result) -> bytes:
    """<name>.json's content."""
    return json_bytes(_jsonable(result.to_dict()))


def _jsonable(x):
    """JSON has no inf/nan: write them as null rather than produce an unreadable file."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def png_of(fig) -> bytes:
    """A benchmark's figure as <name>.png's content (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), dpi=110, squeeze=False)
    return fig, list(axes[0])
