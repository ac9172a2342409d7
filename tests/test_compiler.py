"""gpulab.compiler reads torch.compile through two private doors (compile callbacks, log
artifacts): this pins what they give on the installed torch, with the cheapest backend ("eager":
dynamo traces, nothing is generated), and that reading them changes nothing the user sees."""

from __future__ import annotations

import logging

import pytest
import torch

from gpulab.compiler import DYNAMO_ARTIFACTS, CompileClock, CompileWatch, _artifact_loggers
from torch._logging._internal import log_state


def user_line(frame) -> str | None:
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            return f"test_compiler.py:{frame.f_lineno}"
        frame = frame.f_back
    return None


def step(x: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x) * 2
    if y.sum().item() > 1e9:  # a graph break: .item() inside the compiled function
        y = y + 1
    return y.sum()


@pytest.fixture
def watched():
    torch._dynamo.reset()
    events = []
    watch = CompileWatch(events.append, user_line, lambda path, line: f"{path.rsplit('/', 1)[-1]}:{line}")
    watch.install()
    yield events
    watch.remove()
    torch._dynamo.reset()


def test_compiles_recompiles_and_graph_breaks_come_with_their_reasons_and_lines(watched):
    compiled = torch.compile(step, backend="eager", dynamic=False)
    for n in (4, 6):
        compiled(torch.randn(n, 3))  # the second size fails a guard: a recompile
    kinds = [e.kind for e in watched]
    assert "compile" in kinds and "graph_break" in kinds and "recompile" in kinds
    recompile = next(e for e in watched if e.kind == "recompile")
    assert "size mismatch at index 0" in recompile.reason and recompile.where.startswith("test_compiler.py:")
    assert recompile.compile_id.endswith("/1")  # tied to the compile it caused: the frame's second
    broke = next(e for e in watched if e.kind == "graph_break")
    assert broke.where == f"test_compiler.py:{step.__code__.co_firstlineno + 2}" and "Tensor.item()" in broke.reason
    compiles = [e for e in watched if e.kind == "compile"]
    assert all(e.t1 >= e.t0 for e in compiles) and {e.trigger for e in compiles} == {"dynamo"}


def test_reading_the_logs_prints_nothing_and_leaves_them_as_found(capfd):
    before = {lg.name: (lg.level, lg.propagate, list(lg.handlers)) for a in DYNAMO_ARTIFACTS for lg in _artifact_loggers(a)}
    enabled = set(log_state.artifact_names)
    torch._dynamo.reset()
    events = []
    watch = CompileWatch(events.append, user_line, lambda path, line: f"{path}:{line}")
    watch.install()
    torch.compile(step, backend="eager")(torch.randn(4, 3))
    watch.remove()
    torch._dynamo.reset()
    err = capfd.readouterr().err
    assert "[__graph_breaks]" not in err and "[__recompiles]" not in err  # torch's own handler never saw them
    assert any(e.kind == "graph_break" for e in events)
    after = {lg.name: (lg.level, lg.propagate, list(lg.handlers)) for a in DYNAMO_ARTIFACTS for lg in _artifact_loggers(a)}
    assert after == before and set(log_state.artifact_names) == enabled


def test_the_clock_counts_compile_time_only():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    with CompileClock() as clock:
        compiled(torch.randn(3))
        first = clock.take()
        for _ in range(50):
            compiled(torch.randn(3))  # cached: no compile
        again = clock.take()
    torch._dynamo.reset()
    assert first > 0 and again == 0.0


def test_a_cuda_graph_recorded_again_is_read_with_what_moved_and_for_which_inputs():
    """cudagraph trees say a re-recording only at DEBUG, on their "cudagraphs" artifact logger: the
    line is written here as torch 2.13 writes it (its format string and its own reason wording,
    pinned), into the real logger, without a GPU."""
    import inspect

    import torch._inductor.cudagraph_trees as trees
    from torch._inductor.cudagraph_utils import CheckInvariantStatus, log_cudagraph_skip_and_bump_counter

    line = "[%s] Re-recording function=%s, mode=%s, reason=%s"
    assert line in inspect.getsource(trees)  # torch still says it so
    reason = (f"{CheckInvariantStatus.StaticInputIdxMismatch}.\n"
              "input name: primals_2. data pointer changed from 1024 to 2048. input stack trace: None\n")
    events = []
    watch = CompileWatch(events.append, user_line, lambda path, line: f"{path}:{line}")
    watch.install()
    watch.read_cudagraph_skips()
    try:
        trees.log.debug(line, "0/0", "forward", "CompilationMode.FORWARD", reason)
        # past torch's limit of re-recordings the function runs without graphs, in other words
        assert "skipping cudagraph due to function" in inspect.getsource(trees)
        log_cudagraph_skip_and_bump_counter("skipping cudagraph due to function 0 exceeding max re-recording limit "
                                            "(=50) on cudagraph node None due to static input data pointer changed.")
    finally:
        watch.remove()
    (rerecord,) = [e for e in events if e.kind == "cudagraph_rerecord"]
    assert rerecord.function == "forward" and rerecord.where.startswith("test_compiler.py:")
    assert rerecord.reason == "static input data pointer changed (primals_2)"
    (skipped,) = [e for e in events if e.kind == "cudagraph_skip"]
    assert skipped.reason.startswith("function 0 exceeding max re-recording limit")
    assert trees.log.level == logging.NOTSET  # left as found


def mutating(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x.add_(1)  # planted: writes into its input
    return (x * w).sum()


def test_a_skipped_cuda_graph_names_the_scripts_line_that_wrote_into_an_input():
    """torch's own message for a mutated input, made by its own functions from a graph dynamo and
    AOTAutograd traced on the CPU (what inductor hands cudagraph trees on a GPU), read through the
    real logger: the reason without its stack trace, the script's mutating line in its place, and
    `where` the script's call - never torch's frames."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.cudagraph_utils import (get_mutation_stack_trace, get_placeholder_info,
                                                 log_cudagraph_skip_and_bump_counter)

    traced = []
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, inputs: traced.append(gm) or gm.forward)
    torch.compile(mutating, backend=backend, dynamic=False)(torch.randn(3), torch.randn(3))
    torch._dynamo.reset()
    message = get_mutation_stack_trace(get_placeholder_info(traced[0].graph), [0])  # input 0, x, is written
    assert "Found from" in message
    events = []
    watch = CompileWatch(events.append, user_line,
                         lambda path, line: f"test_compiler.py:{line}" if path == __file__ else None)
    watch.install()
    watch.read_cudagraph_skips()
    try:
        log_cudagraph_skip_and_bump_counter(message)
    finally:
        watch.remove()
    (skipped,) = [e for e in events if e.kind == "cudagraph_skip"]
    planted = mutating.__code__.co_firstlineno + 1
    assert skipped.reason == f"mutated inputs (1 instances): x.add_(1) at test_compiler.py:{planted}"
    assert skipped.where.startswith("test_compiler.py:") and skipped.where != f"test_compiler.py:{planted}"
