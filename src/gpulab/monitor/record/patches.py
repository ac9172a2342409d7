"""Everything the profiler changes in PyTorch and Python while it records, in one place:
PyTorch's own hooks where they exist, a patch where none does. `install(rec)` puts them all in;
`Patches.undo()` takes every one out again, in reverse order. docs/profiling.md lists them, with
the torch version they were checked against (2.13.0).

PyTorch's hooks
    nn.Module forward     register_module_forward_pre_hook / register_module_forward_hook
                          (always_call): the outermost module call is compute; a module called
                          inside a DataLoader fetch is a transform (torchvision's are modules);
                          paused in the fetches where transforms are not timed (transforms.py), by
                          a second patch of DataLoader.__iter__ and _BaseDataLoaderIter.__next__
    Optimizer.step        register_optimizer_step_pre_hook / _post_hook: compute; ends the step
    DDP's parameters      register_post_accumulate_grad_hook (ddp.py): from the last gradient to the
                          end of backward, DDP waits for its allreduce: collective
    gpulab's PhaseTimer   add_phase_listener: gpulab's own trainer's phases (data, scatter, allreduce, ...)
Patches (no hook exists for these; docs/profiling.md says why for each)
    DataLoader.__iter__, _BaseDataLoaderIter.__next__   a fetch is a data wait; which loader fed each step
    DataLoader.__init__   where each loader was built; `gpulab profile --try` (DataLoader settings changed)
    torch.set_num_threads only for `gpulab profile --try threads=N` (the threads tried)
    torch.autograd.backward, torch.autograd.grad        compute; a step ends after it (backward rule)
    Optimizer.zero_grad   compute
    torch.distributed's collectives (DISTRIBUTED_CALLS), Work.wait   collective
    torch.distributed.init_process_group   the process's rank, however the job was launched
    multiprocessing's BaseProcess._bootstrap            a child's recording ends (it leaves with os._exit)
    torchvision's Compose.__init__ / __call__ (v1, once imported)   a span per transform, and where it was built
    signal.signal / alarm / setitimer (stacks.py, installed by the recorder through the same
    `Patches`): the stack sampler gives SIGALRM back before the script takes it
    CUDA builds with a CUDA device only (cuda.py, through the same `Patches`): Tensor's syncing methods,
    Tensor.to / .cuda, torch.cuda.synchronize, Event/Stream.synchronize; torch's sync debug mode
    (torch.cuda.set_sync_debug_mode, public)
Process-wide
    os.register_at_fork   a forked child records as its own lane (a DataLoader worker: nothing)
torch.compile (once the script imports torch._dynamo; compiled.py, gpulab.compiler)
    torch._dynamo.callback's compile start/end callbacks; the log artifacts recompiles,
    graph_breaks, perf_hints read by gpulab's handler (not passed on to torch's own)

Every patch keeps the signature, name and docstring of what it replaces (functools.update_wrapper:
`inspect.signature` follows `__wrapped__`), so frameworks that introspect them work: Lightning
re-creates a DataLoader from the parameters of `DataLoader.__init__`.

Only the thread that started the recorder is recorded: every wrapper lets other threads' calls
straight through (what belongs to the process, not to a thread - where a loader was built, the
rank - is noted from any thread). A second recorder in the same process is refused: the patches
are the shared resource, so that is what `install` checks.
"""

from __future__ import annotations

import inspect
import multiprocessing.process
import os
import sys
import warnings
import weakref
from functools import partial, update_wrapper

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from gpulab.errors import UserError
from gpulab.monitor.record.frames import format_site, user_site
from gpulab.monitor.record.interpreter import after_import

# torch.distributed calls that block until the collective is done (unless async_op=True, when the
# wait comes later, in Work.wait). Each is timed as "collective".
DISTRIBUTED_CALLS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "gather", "scatter", "gather_object", "scatter_object_list",
    "send", "recv",
)

# gpulab's own trainer reports its phases through PhaseTimer; this is where each one belongs.
PHASE_CATEGORY = {
    "data": "data_wait",
    "scatter": "h2d",
    "forward_backward": "compute",
    "allreduce": "collective",
    "optimizer": "compute",
}

_MARK = "__gpulab_patch__"


class Patches:
    """The patches and hooks of one recording session, and how to undo each."""

    def __init__(self):
        self._undo: list = []

    def patch(self, owner, name: str, make_wrapper) -> None:
        """Replace owner.name by make_wrapper(original) until undo(); the wrapper takes the
        original's signature, name and docstring."""
        had_own = name in vars(owner)
        original = getattr(owner, name)
        wrapper = update_wrapper(make_wrapper(original), original)
        setattr(wrapper, _MARK, True)
        setattr(owner, name, wrapper)

        def undo():
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

        self._undo.append(undo)

    def on_undo(self, undo) -> None:
        self._undo.append(undo)

    def ignore_warning(self, message: str) -> None:
        """Hide a warning that gpulab's own hooks cause (`message`: a regex of its start)."""
        warnings.filterwarnings("ignore", message=message)
        added = warnings.filters[0]

        def undo():
            if added in warnings.filters:
                warnings.filters.remove(added)
                warnings._filters_mutated()

        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def installed() -> bool:
    """Is a recorder's set of patches in place in this process?"""
    return getattr(DataLoader.__iter__, _MARK, False)


def install(rec) -> Patches:
    """Hook and patch everything listed above for the recorder `rec`."""
    if installed():
        raise UserError("a gpulab profile is already running in this process: end it before starting another")
    p = Patches()

    def next_batch(iterator):  # the loop is back for data: a backward-rule step ended; then this fetch
        rec.steps.end_step_after_backward()
        rec.loaders.fetching(iterator)

    p.patch(DataLoader, "__init__", partial(_loader_init, rec, rec.cfg.dataloader_overrides))
    p.patch(DataLoader, "__iter__", partial(_loader_iter, rec))
    p.patch(_BaseDataLoaderIter, "__next__", partial(_as_span, rec, "data_wait", "next(DataLoader)", next_batch,
                                                     after=lambda batch: rec.memory.note_inputs(batch)))
    nesting = _Nesting()
    _hook_module_calls(rec, p, nesting)
    p.on_undo(rec.ddp.remove_hooks)  # the gradient hooks DdpWait puts on DDP modules' parameters
    p.patch(torch.autograd, "backward", partial(_autograd, rec, nesting, "backward"))
    p.patch(torch.autograd, "grad", partial(_autograd, rec, nesting, "autograd.grad"))
    p.patch(torch.optim.Optimizer, "zero_grad",
            partial(_as_span, rec, "compute", lambda optimizer: f"{type(optimizer).__name__}.zero_grad", None))
    for handle in (register_optimizer_step_pre_hook(rec.on_optimizer_pre),
                   register_optimizer_step_post_hook(rec.on_optimizer_post)):
        p.on_undo(handle.remove)
    p.patch(multiprocessing.process.BaseProcess, "_bootstrap", partial(_process_bootstrap, rec))
    for module, members_call in (("torchvision.transforms.transforms", True),
                                 ("torchvision.transforms.v2._container", False)):
        p.on_undo(after_import(module, lambda m, c=members_call: _patch_compose(rec, p, m.Compose, c)))
    p.on_undo(after_import("gpulab.parallel.phases", lambda m: p.on_undo(m.add_phase_listener(partial(_phase, rec)))))
    _hook_distributed(rec, p)
    if rec.cfg.torch_threads:
        _force_torch_threads(p, rec.cfg.torch_threads)
    _follow_forks(rec, nesting)
    p.on_undo(after_import("torch._dynamo", lambda dynamo: _watch_compiles(rec, p)))
    rec.cuda.install(p.patch)
    p.on_undo(rec.cuda.uninstall)  # first out: sync debug mode and the warning filter
    return p


def _as_span(rec, category: str, name, before, original, after=None):
    """`original`, timed as a `category` span in the recorded thread. `name`: the span's name, or
    a function of the call's first argument that gives it; `before(first argument)`: what the
    recorder notes first (a step that ended, a DataLoader it has not seen); `after(result)`: what
    it notes of the result (a batch)."""

    def wrapper(*args, **kwargs):
        if not rec.here():
            return original(*args, **kwargs)
        if before is not None:
            before(args[0])
        token = rec.steps.enter(name if isinstance(name, str) else name(args[0]), category)
        try:
            result = original(*args, **kwargs)
        finally:
            rec.steps.exit(token)
        if after is not None:
            after(result)
        return result

    return wrapper


# ----------------------------------------------------------------------------- data

def _loader_init(rec, overrides: dict, original):
    """Every DataLoader built: the recorder notes the line that built it (from any thread: a
    loader made elsewhere may be iterated in the training thread). `--try num_workers=4`: each
    one gets these settings."""
    signature = inspect.signature(original)

    def __init__(loader, *args, **kwargs):
        if overrides:
            bound = signature.bind(loader, *args, **kwargs)
            bound.apply_defaults()
            bound.arguments.update(overrides)
            if not bound.arguments.get("num_workers"):  # these only exist with workers
                bound.arguments["persistent_workers"] = False
                bound.arguments["prefetch_factor"] = None
            args, kwargs = bound.args[1:], bound.kwargs
        original(loader, *args, **kwargs)
        rec.loaders.built(loader, sys._getframe(1))

    return __init__


def _loader_iter(rec, original):
    """A new pass over a DataLoader: a data wait (its workers start here); a backward-rule step
    ended (the loop is back for data); the recorder notes the loader and which iterator is its."""
    timed = _as_span(rec, "data_wait", "DataLoader.__iter__", None, original)

    def __iter__(loader):
        if not rec.here():
            return original(loader)
        rec.steps.end_step_after_backward()
        iterator = timed(loader)
        rec.loaders.iterated(loader, iterator, sys._getframe(1))
        return iterator

    return __iter__


def _patch_compose(rec, p: Patches, compose, members_call: bool) -> None:
    """torchvision's Compose: note where each transform was built; v1 (whose members need not be
    nn.Modules): time each member as its own transform span."""

    def wrap_init(original):
        def __init__(composed, transforms, *args, **kwargs):
            rec.transforms.note_built(transforms, user_site(sys._getframe(1)))
            return original(composed, transforms, *args, **kwargs)
        return __init__

    def wrap_call(original):
        def __call__(composed, img):
            if not (rec.transforms.timing and rec.here() and rec.steps.loading_data()):
                return original(composed, img)
            for t in composed.transforms:  # what Compose.__call__ does, one span per member
                img = t(img) if isinstance(t, torch.nn.Module) else rec.transforms.call(t, t, img)
            return img
        return __call__

    p.patch(compose, "__init__", wrap_init)
    if members_call:
        p.patch(compose, "__call__", wrap_call)


# ----------------------------------------------------------------------------- compute

def _force_torch_threads(p: Patches, threads: int) -> None:
    """`--try threads=N`: torch's intra-op threads are N in this process, also when the script sets
    its own (its torch.set_num_threads(k) sets N instead), as --try forces DataLoader settings."""
    torch.set_num_threads(threads)

    def wrap(original):
        def set_num_threads(requested: int) -> None:
            return original(threads)

        return set_num_threads

    p.patch(torch, "set_num_threads", wrap)


class _Nesting:
    """Is the recorded thread inside the outermost module call, or inside backward? Their inner
    calls add nothing but cost. A forked lane starts outside both (_follow_forks)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.in_forward = False
        self.in_backward = False


def _hook_module_calls(rec, p: Patches, nesting: _Nesting) -> None:
    """The outermost module call is a compute span (a model's submodules add nothing but cost); a
    module called inside a DataLoader fetch is a transform span, while rec.transforms times them
    (transforms.py). In every other fetch the hooks are paused: global hooks send every module
    call through torch's slow path (~1.3 us each, more with what they do), which per-sample
    transforms pay per sample - 8 points of data share in issue 28's mnist_rnn. The iterator's
    start is paused too: DataLoader workers are forked there, and run without the hooks.
    always_call: the span also ends when forward raises."""
    is_compiling = torch.compiler.is_compiling
    open_calls: list[tuple[torch.nn.Module, int, bool]] = []  # (module, token, is a transform)

    def before(module, args):
        if is_compiling() or nesting.in_forward or not rec.here():
            return
        if rec.steps.loading_data():
            token = rec.transforms.begin(module)
            if token is not None:
                open_calls.append((module, token, True))
            return
        rec.steps.end_step_after_backward()
        rec.ddp.note_module(module)
        rec.memory.models.add(module)
        if rec.memory.measuring:
            rec.memory.note_inputs(args)
        nesting.in_forward = True
        open_calls.append((module, rec.steps.enter(type(module).__name__, "compute"), False))

    def after(module, args, output):
        # is_compiling() first: torch.compile traces global hooks, and folds this one away here.
        if is_compiling() or not open_calls or open_calls[-1][0] is not module:
            return
        _, token, transform = open_calls.pop()
        if transform:
            rec.transforms.end(token)
        else:
            nesting.in_forward = False
            rec.steps.exit(token)
            rec.progress.made()  # for the hang watch: an evaluation loop is no hang

    hooks = _PausableHooks(register_module_forward_pre_hook(before),
                           register_module_forward_hook(after, always_call=True))
    p.on_undo(hooks.remove)
    # torch warns that global hooks fire for a compiled module's wrapper too; these expect it (the
    # wrapper is the outermost call) and the warning is about gpulab, not the script.
    p.ignore_warning(r"Using `torch\.compile\(module\)` when there are global hooks")
    p.patch(DataLoader, "__iter__", partial(_with_hooks_paused, rec, hooks, lambda: True))
    p.patch(_BaseDataLoaderIter, "__next__", partial(_with_hooks_paused, rec, hooks, lambda: not rec.transforms.timing))


class _PausableHooks:
    """Global hooks that can be paused: taken out of torch's hook dicts and put back under the
    same key. Not remove() and a new registration: that gives them a new key each time, and
    torch.compile, which guards on those keys, then recompiles the model at every call (measured,
    torch 2.13). The dicts are the ones each hook's RemovableHandle removes it from."""

    def __init__(self, *handles):
        self._handles = handles
        self._paused: list[tuple[dict, int, object]] = []  # (torch's dict, key, value)
        self._depth = 0  # nested pauses (a fetch inside a fetch): the outermost one resumes

    def pause(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        for handle in self._handles:
            for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
                hooks = ref()
                if hooks is not None and handle.id in hooks:
                    self._paused.append((hooks, handle.id, hooks.pop(handle.id)))

    def resume(self) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        for hooks, key, value in self._paused:
            hooks[key] = value
        self._paused.clear()

    def remove(self) -> None:
        for hooks, key, value in self._paused:  # stopped during a pause (an exception in a fetch)
            hooks[key] = value
        self._paused.clear()
        for handle in self._handles:
            handle.remove()


def _with_hooks_paused(rec, hooks: _PausableHooks, pause, original):
    """`original` with the module hooks paused, when `pause()` says so (in the recorded thread)."""

    def wrapper(*args, **kwargs):
        if not (rec.here() and pause()):
            return original(*args, **kwargs)
        hooks.pause()
        try:
            return original(*args, **kwargs)
        finally:
            hooks.resume()

    return wrapper


def _autograd(rec, nesting: _Nesting, name: str, original):
    is_compiling = torch.compiler.is_compiling

    def wrapper(*args, **kwargs):
        if nesting.in_backward or is_compiling() or not rec.here():
            return original(*args, **kwargs)
        rec.steps.end_step_after_backward()  # a loop with neither a DataLoader nor a module call
        nesting.in_backward = True
        token = rec.steps.enter(name, "compute")
        try:
            return original(*args, **kwargs)
        finally:
            nesting.in_backward = False
            rec.ddp.backward_ended(rec.steps)  # DDP's wait for its allreduce, at the end of backward
            rec.steps.exit(token)
            rec.steps.backward_done()

    return wrapper


def _watch_compiles(rec, p: Patches) -> None:
    """torch.compile's compiles and messages (compiled.py), once the script has imported
    torch._dynamo: gpulab.compiler imports it, ~1 s that a script which never does is spared."""
    from gpulab.compiler import CUDAGRAPH_MODULE, CompileWatch

    rec.compiles.install(lambda on_event: CompileWatch(on_event, user_site, format_site))
    p.on_undo(rec.compiles.remove)
    p.on_undo(after_import(CUDAGRAPH_MODULE, lambda trees: rec.compiles.read_cudagraph_skips()))


def _phase(rec, name: str):
    """A phase of gpulab's own trainer (a PhaseTimer listener) is a span of its category."""
    return rec.span(name, PHASE_CATEGORY.get(name, "compute"))


# ----------------------------------------------------------------------------- communication

def _hook_distributed(rec, p: Patches) -> None:
    """Time torch.distributed's collectives and waits as their own category. DDP's bucket waits
    happen inside backward in C++, out of reach: ddp.DdpWait finds them from gradient hooks."""
    if not torch.distributed.is_available():
        return
    import torch.distributed.distributed_c10d as c10d

    for name in DISTRIBUTED_CALLS:
        if not hasattr(c10d, name):
            continue
        original = getattr(c10d, name)
        wrapper = _as_span(rec, "collective", f"dist.{name}", None, original, after=_collective_done(rec))
        # `dist.all_reduce` and `c10d.all_reduce` are one function under two names: patch both.
        for owner in (c10d, torch.distributed):
            if getattr(owner, name, None) is original:
                p.patch(owner, name, lambda orig, w=wrapper: w)
    p.patch(torch._C._distributed_c10d.Work, "wait",
            partial(_as_span, rec, "collective", "Work.wait", None, after=_collective_done(rec)))
    # torch's own modules that call it by a name of their own (device_mesh) get the wrapper too.
    original = c10d.init_process_group
    init = _process_group_init(rec, original)
    for owner in [m for name, m in list(sys.modules.items())
                  if name.startswith("torch.distributed") and getattr(m, "init_process_group", None) is original]:
        p.patch(owner, "init_process_group", lambda orig, w=init: w)


def _collective_done(rec):
    """Progress, for the hang watch: a collective finished."""
    return lambda result: rec.progress.made()


def _process_group_init(rec, original):
    """Once the default process group is up, the recorder notes this process's rank (from any
    thread: the rank is the process's)."""

    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        rec.note_process_group()
        return result

    return init_process_group


# ----------------------------------------------------------------------------- processes

def _process_bootstrap(rec, original):
    """A multiprocessing child leaves with os._exit(), skipping atexit: end its recording here.
    Its target's exception never reaches sys.excepthook either (_bootstrap prints it itself): the
    recorder notes it on its way out of run()."""

    def _bootstrap(process, *args, **kwargs):
        run = process.run

        def run_noting_its_exception():
            try:
                return run()
            except BaseException as e:
                rec.note_exception(e, e.__traceback__)
                raise

        process.run = run_noting_its_exception
        try:
            return original(process, *args, **kwargs)
        finally:
            rec.stop_in_any_process()

    return _bootstrap


def _follow_forks(rec, nesting: _Nesting) -> None:
    """A fork's child inherits the patches and the recorder's state. A DataLoader worker (forked
    while the loader starts its workers) and a child of an in-process session record nothing
    and never write to the parent's file; any other child (multiprocessing, os.fork) is a
    process of the job: it gets its own lane. Fork handlers cannot be removed: this one holds
    the recorder weakly and does nothing once it has stopped."""
    if not hasattr(os, "register_at_fork"):  # not POSIX: nothing forks
        return
    ref = weakref.ref(rec)

    def in_child() -> None:
        recorder = ref()
        if recorder is not None and recorder.recording():
            nesting.reset()
            recorder.after_fork_in_child()

    os.register_at_fork(after_in_child=in_child)
