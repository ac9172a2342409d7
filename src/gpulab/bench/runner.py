"""Running benchmarks: the context they see, and the files each one leaves behind."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.markup import escape

from gpulab import bench
from gpulab.bench.environment import OtherLoad, contention_warning, environment
from gpulab.bench.harness import ResultMismatch
from gpulab.bench.result import Result, json_of, png_of, render
from gpulab.devices import cpu, format_devices, num_gpus
from gpulab.io import OutputFolder, writing_results

OTHER_LOAD_WARN_PCT = 10.0
"""Note in a benchmark's output when other processes used more of the CPU than this meanwhile."""


@dataclass
class Context:
    """What every benchmark is told: preset, the user's devices (if any), where to report progress."""

    preset: str = "full"
    rounds: int | None = None
    """--rounds: the rounds of the benchmarks that run whole contenders in rounds; None: the preset's."""
    devices: list[torch.device] | None = None
    """The devices from --devices, in order (`cpu*4` gives the CPU four times); None: each
    benchmark's default (the CPU plus every GPU, or virtual CPU replicas for multi-device ones)."""
    console: Console = field(default_factory=lambda: Console(highlight=False))
    _status: object = None

    def gpus(self) -> list[torch.device]:
        """The GPUs to measure: those in --devices, else every GPU torch can see."""
        if self.devices is not None:
            return list(dict.fromkeys(d for d in self.devices if d.type == "cuda"))
        return [torch.device(f"cuda:{i}") for i in range(num_gpus())]

    def single_devices(self) -> list[torch.device]:
        """Each distinct device once, for benchmarks that run on one device at a time."""
        if self.devices is not None:
            return list(dict.fromkeys(self.devices))
        return [cpu(), *self.gpus()]

    def no_gpu_reason(self) -> str:
        """Why there are no GPU rows, in words a user can act on."""
        if self.devices is not None and num_gpus():
            return f"--devices {_spec(self.devices)} names no GPU"
        if torch.version.cuda is None:
            return f"no GPU: this torch ({torch.__version__}) is a CPU-only build"
        return "no CUDA GPU visible to torch (check the driver and CUDA_VISIBLE_DEVICES)"

    def progress(self, text: str) -> None:
        """Show what is being measured now (a transient spinner on a terminal; nothing in a log)."""
        if self._status is not None:
            self._status.update(escape(f"{text} ..."))


def _spec(devices: list[torch.device]) -> str:
    return format_devices(devices).strip("[]")


def run_benchmark(name: str, ctx: Context, out: OutputFolder, command: str | None = None, env: dict | None = None) -> Result:
    """Run one benchmark, print its tables, write DIR/<name>.json and DIR/<name>.png (both or neither)."""
    module = bench.load(name)
    cfg = bench.config(module, ctx.preset, ctx.rounds)
    result = Result(
        name=name, lesson=module.LESSON, config=asdict(cfg), env=env or environment(), preset=ctx.preset, command=command
    )
    ctx.console.rule(f"[bold]{name}[/]")
    ctx.console.print(escape(module.LESSON), style="italic")
    started = time.perf_counter()
    other_load = OtherLoad()
    status = ctx.console.status(f"{name} ...") if ctx.console.is_terminal else nullcontext()
    with status as spinner:
        ctx._status = spinner
        try:
            module.run(cfg, ctx, result)
        except ResultMismatch as e:
            # A wrong result makes every timing of it meaningless: say so loudly, keep going.
            result.status, result.error = "failed", str(e)
        finally:
            ctx._status = None
    result.wall_s = time.perf_counter() - started
    result.other_load_pct = round(other_load.pct(), 1)
    if result.other_load_pct > OTHER_LOAD_WARN_PCT:
        result.note(contention_warning(result.other_load_pct, "meanwhile"))
    render(result, ctx.console)
    if result.error:
        ctx.console.print(f"[bold red]FAILED[/] {escape(result.error)}")
    files = {f"{name}.json": json_of(result), f"{name}.png": png_of(module.plot(result))}
    with writing_results():  # a full disk: one line, and neither file replaced
        out.write(files, together=True)
    ctx.console.print(f"wrote {out.path / name}.json, .png ({result.wall_s:.0f} s)", style="dim")
    return result
