"""torch.compile in the recorded process: its compiles as time of their own ("compile"), and what
it says of recompiles, graph breaks and CUDA graphs it skips, each with the script's line.

gpulab.compiler reads torch's two private doors (compile callbacks, log artifacts); this probe
turns what it reads into records. It installs when the script's process imports torch._dynamo
(a script that never compiles still does, for its optimizer: torch.optim imports it), and costs
nothing between compiles: no hook runs on a step. A compile in the recorded thread is a closed
span of category "compile", so the step it happened in says how much of it was compiling;
every compile, recompile, graph break and skip is also one "compile" record (they are few: one
per compile of a frame, and torch stops recompiling a frame after its recompile limit).
"""

from __future__ import annotations

from collections.abc import Callable

from gpulab.monitor.events import CompileRecord


class CompileProbe:
    """`span(name, category, t0, t1)` and `emit(record)`: the recorder's sink; `here()`: is the
    caller the recorded thread."""

    def __init__(self, span: Callable[[str, str, float, float], None], emit: Callable[[dict], None],
                 here: Callable[[], bool]):
        self._span = span
        self._emit = emit
        self._here = here
        self._watch = None
        self.compiles = 0

    def install(self, watch_factory) -> None:
        """`watch_factory(on_event)`: a gpulab.compiler.CompileWatch reporting to on_event."""
        self._watch = watch_factory(self._on_event)
        self._watch.install()

    def read_cudagraph_skips(self) -> None:
        """Once inductor's CUDA graph trees are imported (mode="reduce-overhead")."""
        if self._watch is not None:
            self._watch.read_cudagraph_skips()

    def remove(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def _on_event(self, event) -> None:
        if event.kind == "compile":
            self.compiles += 1
            if self._here():
                self._span(f"compile {event.compile_id} ({event.trigger})", "compile", event.t0, event.t1)
        record: CompileRecord = {"type": "compile", "kind": event.kind, "t0": event.t0, "t1": event.t1,
                                 "compile_id": event.compile_id, "trigger": event.trigger,
                                 "function": event.function, "where": event.where, "reason": event.reason}
        self._emit(record)
