"""The compile probe: torch.compile in the recorded process - each compile a span and a record of
its own ("compile"), and its recompiles, graph breaks and skipped CUDA graphs as records with the
script's line; each compile also a compiled notice (the memory window then adds no global module
hooks, on which compiled code guards). gpulab.compiler reads torch's private doors (compile
callbacks, log artifacts); nothing runs on a step. It starts when the process imports
torch._dynamo (torch.optim does), not before: gpulab.compiler imports it, ~1 s a script that
never does is spared.
"""

from __future__ import annotations

import importlib

from gpulab.monitor.events import CompileRecord
from gpulab.monitor.record.frames import format_site, is_user_file, user_site
from gpulab.monitor.record.interpreter import after_import
from gpulab.monitor.record.patches import lift, mark_recorder_frames, relink
from gpulab.monitor.record.probe import Probe


class CompileProbe(Probe):
    def __init__(self):
        self._watch = None

    def hook(self) -> None:
        # The watch starts once gpulab.compiler has been executed whole. A script that imports
        # torch._dynamo has gpulab.compiler imported for it; a script that imports gpulab.compiler
        # (gpulab train, profiled) imports torch._dynamo from inside it - that import's hook then
        # finds gpulab.compiler half-executed, and the watch starts when gpulab.compiler's own
        # import ends.
        self.patches.on_undo(after_import("gpulab.compiler", self._watch_compiles))
        self.patches.on_undo(after_import("torch._dynamo", self._import_compiler))

    def _import_compiler(self, dynamo) -> None:
        importlib.import_module("gpulab.compiler")  # half-executed already: returned as it is

    def _watch_compiles(self, compiler) -> None:
        mark_recorder_frames(compiler.leave_uncompiled)
        # while it compiles, torch's own functions in place of gpulab's wrappers: dynamo traces what it
        # traces without gpulab
        self._watch = compiler.CompileWatch(self._on_event, user_site, users_site, while_compiling=(lift, relink))
        self._watch.install()
        self.patches.on_undo(self._stop_watching)
        self.patches.on_undo(after_import(compiler.CUDAGRAPH_MODULE, self._read_cudagraph_skips))

    def _read_cudagraph_skips(self, trees) -> None:
        """Once inductor's CUDA graph trees are imported (mode="reduce-overhead")."""
        if self._watch is not None:
            self._watch.read_cudagraph_skips()

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def _on_event(self, event) -> None:
        sink = self.sink
        if event.kind == "compile":
            sink.notices.compiled.send()
            if sink.here():
                sink.steps.add_closed_span(f"compile {event.compile_id} ({event.trigger})", "compile", event.t0, event.t1)
        record: CompileRecord = {"type": "compile", "kind": event.kind, "t0": event.t0, "t1": event.t1,
                                 "compile_id": event.compile_id, "trigger": event.trigger,
                                 "function": event.function, "where": event.where, "reason": event.reason,
                                 "defined_at": event.defined_at}
        self.sink.emit(record)


def users_site(path: str, line: int) -> str | None:
    """`path:line` as the report writes it, when the file is the script's (not torch's, nor code
    torch.compile generated); else None."""
    return format_site(path, line) if is_user_file(path) else None
