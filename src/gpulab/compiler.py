"""What torch.compile does in this process: when it compiles (first compiles, recompiles, the lazy
compile of a backward, CUDA graph recordings), and what it says of recompiles, graph breaks,
CUDA graphs it skips and CUDA graphs it records again.

torch has no public door for either, so this module is the one place that uses the private
ones (tests/test_compiler.py pins what they give on the installed torch):
- torch._dynamo.callback: start and end callbacks around each compile, with what triggered it
  (dynamo, a lazy backward, a CUDA graph recording) and its compile id ("1/0": frame 1, first
  compile; "1/1": its first recompile);
- torch._logging's artifacts "recompiles" and "graph_breaks" (dynamo's, read once it is
  imported) and "cudagraphs" (inductor's CUDA graph trees, read once those are imported:
  `read_cudagraph_skips`; their re-recordings are DEBUG lines, which reading at DEBUG turns on),
  enabled in its log state and read by a handler of ours on their
  loggers, which then stop passing them on to torch's own handler: the script's stderr shows only
  what it showed before (an artifact the user turned on, TORCH_LOGS=recompiles, is left as the
  user set it and read too). A logger made after its artifact is read is not read: each artifact
  is read when every module that writes it has been imported.

- torch._dynamo's frame execution strategies: `leave_uncompiled` marks a code object's frames
  to run uncompiled, as the frames of torch's own files run (the profiler's, which compiled code
  must never see: gpulab/monitor/record/patches.py).

`CompileClock` (gpulab train: compile time reported apart from the epochs) uses the callbacks;
`CompileWatch` (gpulab profile's compile probe) uses both.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType

import torch._dynamo.callback as dynamo_callback
from torch._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch._logging._internal import log_state

# What each artifact carries, and the message that marks it (torch 2.13's wording).
DYNAMO_ARTIFACTS = ("recompiles", "graph_breaks")
CUDAGRAPH_ARTIFACT = "cudagraphs"
CUDAGRAPH_MODULE = "torch._inductor.cudagraph_trees"  # imports cudagraph_utils, the skips' writer
_RECOMPILE = re.compile(r"Recompiling function (?P<function>\S+) in (?P<where>\S+)\s+triggered by the following "
                        r"guard failure\(s\):\s*(?P<reasons>.*)", re.S)
_GRAPH_BREAK = re.compile(r"Graph break.*? in user code at (?P<where>\S+)\s*\nGraph Break Reason: (?P<reason>.*)", re.S)
# "skipping cudagraphs due to mutated inputs", but "skipping cudagraph due to function 0 exceeding
# max re-recording limit": both wordings are torch's
_CUDAGRAPH_SKIP = re.compile(r"skipping cudagraphs? due to (?P<reason>.*)", re.S)
# after a skip's reason, the stack trace of the traced code that caused it (for a mutated input:
# the line that writes into it), as traceback.format_list writes frames
_FOUND_FROM = re.compile(r"\.?\s*Found from\s*:", re.S)
_TRACE_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in [^\n]*\n[ \t]*(?P<code>[^\n]*)')
# cudagraph trees' DEBUG line when a recorded graph cannot be replayed and is recorded again
_CUDAGRAPH_RERECORD = re.compile(r"Re-recording function=(?P<function>.*?), mode=\S+, reason=(?P<reason>.*)", re.S)


class CompileClock:
    """Seconds this process spent compiling, from torch.compile's own start and end callbacks
    (the outermost of nested ones): `take()` is what accrued since the last take."""

    def __init__(self):
        self._since: float | None = None
        self._total = 0.0
        self._taken = 0.0

    def __enter__(self) -> "CompileClock":
        dynamo_callback.callback_handler.register_start_callback(self._start)
        dynamo_callback.callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc) -> None:
        dynamo_callback.callback_handler.remove_start_callback(self._start)
        dynamo_callback.callback_handler.remove_end_callback(self._end)

    def _start(self, args) -> None:
        self._since = time.perf_counter()

    def _end(self, args) -> None:
        if self._since is not None:
            self._total += time.perf_counter() - self._since
            self._since = None

    def take(self) -> float:
        seconds, self._taken = self._total - self._taken, self._total
        return seconds


def leave_uncompiled(code: CodeType, callees: bool = True) -> None:
    """dynamo runs every frame of `code` as plain Python, never a frame to compile - and with
    `callees`, every frame it calls too (what torch.compiler.disable does to a function, without
    wrapping it); without, the frames it calls are dynamo's to compile or not, as ever."""
    then = FrameAction.SKIP if callees else FrameAction.DEFAULT
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, then))


@dataclass
class CompileEvent:
    """Something torch.compile did or said. kind: compile (with its seconds), recompile,
    graph_break, cudagraph_skip, cudagraph_rerecord; `where`: the script's line it happened at
    (the call into the compiled code, or the line that broke the graph); `reason`: torch's words;
    `defined_at`: a recompiled function's own first line (under a framework the script's call is
    `trainer.fit`, and the function that recompiled is its `training_step`)."""

    kind: str
    t0: float
    t1: float
    compile_id: str | None = None
    trigger: str | None = None  # compile: dynamo, lazy_backward, cudagraph_recording
    function: str | None = None
    where: str | None = None
    reason: str | None = None
    defined_at: str | None = None


class CompileWatch:
    """torch.compile's compiles and messages, as they happen, to `on_event(CompileEvent)`.
    `user_line(frame)`: the script's file:line at or above a frame; `format_site(path, line)`: a
    file:line as the report writes it, None where it is not the script's (torch's own, generated
    code) (the caller's rules, both); `while_compiling`: what to call as each compile starts and
    ends."""

    def __init__(self, on_event: Callable[[CompileEvent], None], user_line: Callable[[object], str | None],
                 format_site: Callable[[str, int], str],
                 while_compiling: tuple[Callable[[], None], Callable[[], None]] = (lambda: None, lambda: None)):
        self._on_event = on_event
        self._compile_starts, self._compile_ends = while_compiling  # called around every compile
        self._user_line = user_line
        self._format_site = format_site
        self._open: dict[str, tuple[float, str]] = {}  # compile id -> (start, trigger)
        self._recompiling: CompileEvent | None = None  # logged just before the compile it causes starts
        self._handler = _Handler(self._on_log)
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        dynamo_callback.callback_handler.register_start_callback(self._start)
        dynamo_callback.callback_handler.register_end_callback(self._end)
        self._undo.append(lambda: dynamo_callback.callback_handler.remove_start_callback(self._start))
        self._undo.append(lambda: dynamo_callback.callback_handler.remove_end_callback(self._end))
        for artifact in DYNAMO_ARTIFACTS:
            self._read_artifact(artifact)

    def read_cudagraph_skips(self) -> None:
        """Once inductor's CUDA graph trees are imported (mode="reduce-overhead")."""
        self._read_artifact(CUDAGRAPH_ARTIFACT)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _read_artifact(self, artifact: str) -> None:
        """Turn the artifact on (unless the user did) and read it from every logger that writes it."""
        was_on = log_state.is_artifact_enabled(artifact)
        if not was_on:
            log_state.enable_artifact(artifact)
            self._undo.append(lambda: log_state.artifact_names.discard(artifact))
        for logger in _artifact_loggers(artifact):
            saved = (logger.level, logger.propagate)
            logger.addHandler(self._handler)
            if logger.level == logging.NOTSET or logger.level > logging.DEBUG:
                logger.setLevel(logging.DEBUG)
            if not was_on:
                logger.propagate = False  # not to torch's handler: the user did not ask to see it
            self._undo.append(lambda lg=logger, s=saved: _restore(lg, self._handler, *s))

    # ------------------------------------------------------------------ callbacks

    def _start(self, args) -> None:
        self._compile_starts()
        self._open[args.compile_id] = (time.perf_counter(), args.callback_trigger.name.lower())
        if self._recompiling is not None:  # the recompile this compile is: its id ties the two
            event, self._recompiling = self._recompiling, None
            event.compile_id = str(args.compile_id)
            self._on_event(event)

    def _end(self, args) -> None:
        self._compile_ends()
        opened = self._open.pop(args.compile_id, None)
        if opened is None:
            return
        t0, trigger = opened
        self._on_event(CompileEvent("compile", t0, time.perf_counter(), compile_id=str(args.compile_id),
                                    trigger=trigger, where=self._user_line(sys._getframe(1))))

    def _on_log(self, message: str) -> None:
        now = time.perf_counter()
        where = self._user_line(sys._getframe(1))
        if m := _RECOMPILE.search(message):
            # a function of torch's own (dynamo's wrapper of a compiled module's call) is no name to give
            defined_at = self._site(m["where"], None)
            self._recompiling = CompileEvent("recompile", now, now, function=m["function"] if defined_at else None,
                                             where=where, reason=_guard_failures(m["reasons"]), defined_at=defined_at)
        elif m := _GRAPH_BREAK.search(message):
            self._on_event(CompileEvent("graph_break", now, now, where=self._site(m["where"], where),
                                        reason=_graph_break_reason(m["reason"])))
        elif m := _CUDAGRAPH_SKIP.search(message):
            self._on_event(CompileEvent("cudagraph_skip", now, now, where=where, reason=self._skip_reason(m["reason"])))
        elif m := _CUDAGRAPH_RERECORD.search(message):
            self._on_event(CompileEvent("cudagraph_rerecord", now, now, function=m["function"], where=where,
                                        reason=_rerecord_reason(m["reason"])))

    def _skip_reason(self, text: str) -> str:
        """torch's reason, and in place of its stack trace the script's line it points at, as code
        and place: "mutated inputs (1 instances): x.add_(1) at train.py:9" (a trace that points
        only into torch or generated code adds nothing)."""
        head, *trace = _FOUND_FROM.split(text, maxsplit=1)
        reason = " ".join(head.split())
        frames = [(self._format_site(f["path"], int(f["line"])), f["code"].split("  #")[0].strip())  # not its comment
                  for f in _TRACE_FRAME.finditer(trace[0] if trace else "")]
        scripts = [(site, code) for site, code in frames if site]
        if not scripts:
            return reason
        site, code = scripts[-1]  # the innermost of the script's frames: the line itself
        return f"{reason}: {code} at {site}" if code else f"{reason} at {site}"

    def _site(self, text: str, otherwise: str | None) -> str | None:
        """torch's "path:line" as the report writes a line, or `otherwise` when it is not one of the
        script's (torch.compile(module) recompiles dynamo's own wrapper of the call, in torch)."""
        path, _, line = text.rpartition(":")
        site = self._format_site(path, int(line)) if line.isdigit() else None
        return site or otherwise


class _Handler(logging.Handler):
    def __init__(self, on_message: Callable[[str], None]):
        super().__init__(logging.DEBUG)
        self._on_message = on_message

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._on_message(record.getMessage())
        except Exception:  # a message of another shape: never the script's problem
            pass


def _artifact_loggers(artifact: str) -> list[logging.Logger]:
    """torch's loggers for an artifact: one per module that writes it ("<module>.__<artifact>")."""
    suffix = f".__{artifact}"
    return [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.endswith(suffix)]


def _restore(logger: logging.Logger, handler: logging.Handler, level: int, propagate: bool) -> None:
    logger.removeHandler(handler)
    logger.setLevel(level)
    logger.propagate = propagate


def _guard_failures(text: str) -> str:
    """The failed guards, once each: torch lists them per cached graph ("- 0/1: tensor 'x' size
    mismatch ...", "- 0/0: ...") and may follow one with the source line and a user stack."""
    failures = []
    for line in text.splitlines():
        m = re.match(r"\s*-\s*\d+/\d+:\s*(.*)", line)
        if m:
            failures.append(m[1].split("  #")[0].strip())  # the guard, not the source line torch appends
    return "; ".join(dict.fromkeys(failures)) or " ".join(text.split())[:300]


def _rerecord_reason(text: str) -> str:
    """What changed ("static input data pointer changed") and the inputs it changed for, not
    their addresses and stacks: "static input data pointer changed (primals_2, primals_4)"."""
    lines = text.strip().splitlines()
    inputs = [m[1] for line in lines[1:] if (m := re.match(r"input name: ([^.\s]+)", line))]
    head = lines[0].strip().rstrip(".") if lines else ""
    return head + (f" ({', '.join(dict.fromkeys(inputs))})" if inputs else "")


def _graph_break_reason(text: str) -> str:
    """torch's title of the break and its hint ("Unsupported Tensor.item() call with
    capture_scalar_outputs=False (hint: Set torch._dynamo.config.capture_scalar_outputs = True
    ...)"), not the "Encountered graph break when attempting to trace CALL" that leads them."""
    paragraphs = [p.strip() for p in text.strip().split("\n\n") if p.strip()]
    if len(paragraphs) > 1 and paragraphs[0].startswith("Encountered graph break"):
        paragraphs = paragraphs[1:]
    lines = [line.strip() for line in paragraphs[0].splitlines()] if paragraphs else [""]
    hint = next((line.removeprefix("Hint:").strip() for line in lines if line.startswith("Hint:")), None)
    return lines[0] + (f" (hint: {hint})" if hint else "")


