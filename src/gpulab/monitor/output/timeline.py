"""timeline.png: utilization over time, with the steps and the time spent waiting for data.

Four rows sharing the time axis:
  steps    each step as a bar split into its phases, a row per process that trained
  device   GPU: NVML kernel-active % (and GPM SM-active % on Hopper+); CPU run: compute % of each step
  memory   GPU memory used, the processes' resident memory, torch's live bytes in the measured step
  CPU      the training process and its workers (100 % = one core)
Waiting for data is a strip along the bottom of every row, darker where more of that moment was
spent waiting (readable at 10 steps or 10,000); thin lines mark step boundaries when few enough.
Legends sit right of the plots, never on the data, and name only what occurred. The script's
start-up is left off the time axis and said in words, so that a short script's training is not
squeezed into its last tenth.
"""

from __future__ import annotations

import io

from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from gpulab.monitor.events import Recording

# A step's phases, in the order drawn: colour and legend.
COLORS = {"data_wait": "#f28e2b", "h2d": "#b07aa1", "compute": "#59a14f", "collective": "#4e79a7", "sync": "#e15759",
          "other": "#bab0ac"}
LABELS = {"data_wait": "data wait", "h2d": "host-to-device copy", "compute": "compute",
          "collective": "collectives (allreduce, ...)", "sync": "host sync", "other": "other (Python)"}
_MAX_STEP_LINES = 60  # more step boundaries would grey the rows like hatching: they are left out


def render(lanes: list[Recording], samples: list[dict], gpus: list[dict], report: dict, title: str) -> bytes:
    buf = io.BytesIO()
    figure(lanes, samples, gpus, report, title).savefig(buf, format="png")
    return buf.getvalue()


def figure(lanes: list[Recording], samples: list[dict], gpus: list[dict], report: dict, title: str) -> Figure:
    """The first lane is the diagnosed process; every lane gets a row of steps."""
    rec = lanes[0]
    origin = time_origin(lanes, samples)
    fig = Figure(figsize=(12.5, 8.5), dpi=110)
    axes = fig.subplots(4, 1, sharex=True, gridspec_kw={"height_ratios": [0.8 * min(len(lanes), 4), 2, 1.5, 1.5]})
    ax_steps, ax_device, ax_memory, ax_cpu = axes
    steps = rec.steps + ([rec.tail] if rec.tail else [])
    on_gpu = bool(gpus and any(s["gpus"] for s in samples))

    names = [f"rank {r.rank}" if r.rank is not None else f"pid {r.pid}" for r in lanes]
    _plot_steps(ax_steps, [steps + rec.blocks] + [r.steps + r.blocks for r in lanes[1:]], names, origin, on_gpu)
    _mark_waiting(ax_steps, report.get("stalls") or [], names, origin)
    if on_gpu:
        _plot_gpu_activity(ax_device, samples, gpus, origin)
    else:
        waited = [(x["t0"], x["t1"]) for x in report.get("stalls") or [] if names[0] in x["waiting"]]
        _plot_cpu_compute(ax_device, rec.steps + rec.blocks, origin, waited)
    _plot_memory(ax_memory, samples, gpus, origin, rec.memory)
    _plot_cpu(ax_cpu, samples, rec.start.get("cpu_count"), origin)

    strip = _data_wait_strip([(a - origin, b - a) for s in steps for a, b in s.get("data", [])])
    for ax in axes[1:]:
        if strip:
            bins, colors = strip
            ax.broken_barh(bins, (0, STRIP), transform=ax.get_xaxis_transform(), facecolors=colors, linewidth=0,
                           label="waiting for data (darker: more of the time)")
        if len(rec.steps) <= _MAX_STEP_LINES:
            ax.vlines([s["t1"] - origin for s in rec.steps], 0, 1, transform=ax.get_xaxis_transform(),
                      colors="k", linewidth=0.4, alpha=0.25)
        ax.grid(alpha=0.25)
        if ax.get_legend_handles_labels()[0]:
            _legend(ax)
    _leave_out_start_up(ax_cpu, rec, steps, origin)
    # The title names the user's script or run: a `$` in it must not start mathtext, which fails
    # on anything but valid TeX and would lose the whole image.
    fig.suptitle(_headline(report, title), fontsize=10, parse_math=False)
    fig.subplots_adjust(left=0.07, right=0.78, top=0.93, bottom=0.06, hspace=0.12)  # tight_layout: +0.25 s
    return fig


STRIP = 0.06  # the data-wait strip's height, a share of each row
STRIP_BINS = 240


def _data_wait_strip(spans: list[tuple[float, float]]) -> tuple[list, list] | None:
    """Time spent waiting for data, binned along the axis: (bins as (start, width), their colours),
    each shaded by the share of it spent waiting (a few long waits and thousands of short ones read
    alike); None without waits."""
    if not spans:
        return None
    lo, hi = min(a for a, _ in spans), max(a + w for a, w in spans)
    width = max(hi - lo, 1e-9) / STRIP_BINS
    share = [0.0] * STRIP_BINS
    for a, w in spans:
        first, last = int((a - lo) / width), min(STRIP_BINS - 1, int((a + w - lo) / width))
        for b in range(first, last + 1):
            overlap = min(a + w, lo + (b + 1) * width) - max(a, lo + b * width)
            share[b] += max(0.0, overlap) / width
    bins = [(lo + b * width, width) for b in range(STRIP_BINS) if share[b] > 0]
    # Shade by share: a 1% wait stays faint, half the time waiting is solid.
    colors = [to_rgba(COLORS["data_wait"], min(1.0, 0.05 + 2 * share[b])) for b in range(STRIP_BINS) if share[b] > 0]
    return bins, colors


def _leave_out_start_up(ax, rec: Recording, steps: list[dict], origin: float) -> None:
    """Start the time axis shortly before the first step; say how long the start-up took."""
    ax.set_xlabel("seconds since the script started")
    if not rec.steps:
        ax.set_xlim(left=0)
        return
    first, last = rec.steps[0]["t0"] - origin, steps[-1]["t1"] - origin
    margin = 0.03 * max(last - first, 1e-3)
    if first <= 4 * margin:  # a start-up too short to matter: show it
        ax.set_xlim(left=0)
        return
    ax.set_xlim(left=first - margin)
    ax.set_xlabel(f"seconds since the script started (its first {first:.1f} s, start-up before the first step: "
                  "imports, data, model, not drawn)")


def time_origin(lanes: list[Recording], samples: list[dict]) -> float:
    """Time zero of the plots and the trace: when the first process (or the sampler) started."""
    starts = [r.t_start for r in lanes] + [samples[0]["t"] if samples else None]
    candidates = [t for t in starts if t is not None]
    if not candidates:
        candidates = [r.steps[0]["t0"] for r in lanes if r.steps]
    return min(candidates) if candidates else 0.0


def _headline(report: dict, title: str) -> str:
    top = report["findings"][0] if report["findings"] else None
    step = report["step_time_s"]
    line = f"{title}: {report['steps']} steps, median {step['median'] * 1e3:.1f} ms"
    if top:
        found = top["cause"] != "none"
        line += (f"  |  {top['cause']} {top['share']:.0%} of {top.get('share_of', 'step time')}" if found
                 else "  |  nothing stands out")
    return line


def _plot_steps(ax, lanes: list[list[dict]], names: list[str], origin: float, on_gpu: bool) -> None:
    """Each step (after the detailed window, each block of steps) as a bar from its start, split into
    its phases; a row per training process. Without a GPU there is no host-to-device copy: a `.to()`
    on the CPU is Python time ("other")."""
    for row, steps in enumerate(reversed(lanes)):
        bars: dict[str, list[tuple[float, float]]] = {c: [] for c in COLORS}
        for s in steps:
            x = s["t0"] - origin
            excl = dict(s["excl"])
            if not on_gpu:
                excl["other"] = excl.get("other", 0.0) + excl.pop("h2d", 0.0)
            for category in COLORS:
                width = excl.get(category, 0.0)
                if width > 0:
                    bars[category].append((x, width))
                    x += width
        for category, xranges in bars.items():
            if xranges:
                ax.broken_barh(xranges, (row + 0.05, 0.9), facecolors=COLORS[category], linewidth=0,
                               label=LABELS[category] if row == 0 else None)
    if len(lanes) > 1:
        ax.set_yticks([row + 0.5 for row in range(len(lanes))], list(reversed(names)), fontsize=7)
    else:
        ax.set_yticks([])
    ax.set_ylabel("steps", fontsize=8)
    ax.set_ylim(0, len(lanes))
    if ax.get_legend_handles_labels()[0]:
        _legend(ax)


def _mark_waiting(ax, stalls: list[dict], names: list[str], origin: float) -> None:
    """A stall's waiting ranks spent it inside a collective (or DDP's backward, counted as compute):
    hatched over their bars as waiting."""
    rows = {name: len(names) - 1 - i for i, name in enumerate(names)}
    labelled = False
    for stall in stalls:
        for name in stall["waiting"]:
            if name not in rows:
                continue
            ax.broken_barh([(stall["t0"] - origin, stall["t1"] - stall["t0"])], (rows[name] + 0.05, 0.9),
                           facecolors="white", edgecolors=COLORS["collective"], hatch="///", linewidth=0.6,
                           label=None if labelled else f"waiting for {stall['who']} (a stall)")
            labelled = True
    if labelled:
        _legend(ax)


def _gpu_rows(samples: list[dict], position: int, origin: float) -> tuple[list[float], list[dict]]:
    """The times and readings of the GPU at `position` in the samples."""
    inside = [s for s in samples if len(s["gpus"]) > position]
    return [s["t"] - origin for s in inside], [s["gpus"][position] for s in inside]


def _proc_rows(samples: list[dict], origin: float) -> tuple[list[float], list[dict]]:
    """The times and readings of the training process in the samples."""
    inside = [s for s in samples if s.get("proc")]
    return [s["t"] - origin for s in inside], [s["proc"] for s in inside]


def _plot_gpu_activity(ax, samples: list[dict], gpus: list[dict], origin: float) -> None:
    for position, info in enumerate(gpus):
        t, rows = _gpu_rows(samples, position, origin)
        name = f"GPU{info['index']}"
        _line(ax, t, [r.get("kernel_active_pct") for r in rows], f"{name} kernel active % (NVML util)", "-")
        _line(ax, t, [r.get("sm_active_pct") for r in rows], f"{name} SM active % (GPM)", "--")
        _line(ax, t, [r.get("tensor_active_pct") for r in rows], f"{name} tensor pipes active % (GPM)", ":")
    ax.set_ylim(0, 105)
    ax.set_ylabel("GPU %", fontsize=8)


def _plot_cpu_compute(ax, steps: list[dict], origin: float, waited: list[tuple[float, float]]) -> None:
    """No GPU: the CPU is the device; the share of each step that was torch compute, less the
    time it waited for a stalled rank (inside DDP's backward that wait counts as compute)."""
    t = [s["t1"] - origin for s in steps]

    def computed(s: dict) -> float:
        wait = sum(max(0.0, min(s["t1"], b) - max(s["t0"], a)) for a, b in waited)
        return max(0.0, s["excl"].get("compute", 0.0) - wait)

    share = [100 * computed(s) / max(s["t1"] - s["t0"], 1e-12) for s in steps]
    if t:
        ax.step(t, share, where="pre", color=COLORS["compute"], label="compute % of each step (CPU run, no GPU)")
    ax.set_ylim(0, 105)
    ax.set_ylabel("compute %", fontsize=8)


def _plot_memory(ax, samples: list[dict], gpus: list[dict], origin: float, measured: dict | None) -> None:
    """Sampled memory (NVML, psutil), and torch's live bytes through the step the memory window
    measured (a short, tall line where that step ran)."""
    for position, info in enumerate(gpus):
        t, rows = _gpu_rows(samples, position, origin)
        used = [r.get("memory_used_mib") for r in rows]
        _line(ax, t, [u / 1024 if u is not None else None for u in used], f"GPU{info['index']} memory used", "-")
    t, procs = _proc_rows(samples, origin)
    _line(ax, t, [p["rss_mib"] / 1024 for p in procs], "process RSS", "-.")
    if any(p["workers"] for p in procs):
        _line(ax, t, [p["workers_rss_mib"] / 1024 for p in procs], "workers RSS", ":")
    if measured and measured.get("curve"):
        curve = measured["curve"]
        _line(ax, [c[0] - origin for c in curve], [c[1] / 2**30 for c in curve],
              f"torch live bytes, measured step ({measured['device']})", "-", color="#7a1f5c")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("GiB", fontsize=8)


def _plot_cpu(ax, samples: list[dict], cores: int | None, origin: float) -> None:
    t, procs = _proc_rows(samples, origin)
    _line(ax, t, [p["cpu_pct"] for p in procs], "training process", "-")
    if any(p["workers"] for p in procs):
        _line(ax, t, [p["workers_cpu_pct"] for p in procs], "child processes (DataLoader workers, ranks)", "--")
    ax.set_ylim(bottom=0)
    ax.set_ylabel(f"CPU %\n(100 = 1 of {cores} cores)" if cores else "CPU %\n(100 = 1 core)", fontsize=8)


def _legend(ax) -> None:
    """Right of the plots; labels name devices and processes from the recording: never mathtext."""
    legend = ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    for text in legend.get_texts():
        text.set_parse_math(False)


def _line(ax, t: list[float], values: list, label: str, style: str, color: str | None = None) -> None:
    points = [(x, v) for x, v in zip(t, values) if v is not None]
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, style, linewidth=1.1, label=label, color=color)
