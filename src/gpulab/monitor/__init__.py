"""See where the time goes.

    profile(out=...)   profile a training loop in this process (`with ... as p:`; `p.step()`)

(the background sampler of GPUs and the process is parent/sampler.py's Sampler).

`gpulab profile -- python script.py` does the same for an unmodified script (parent/runner.py
runs it with record/autostart/ on its PYTHONPATH); `gpulab train --profile` for gpulab's own
trainer, whose per-phase step timer is gpulab.train.step.PhaseTimer (the profiler listens to
its phases).

Importing this package does not import torch: the profiler's bootstrap must let the user's script
be the one that imports it (a script may set OMP_NUM_THREADS first). Nor anything else of the
profiler: `gpulab train` imports it for --profile, and a run without it pays nothing.
"""


def profile(out="profile", **settings):
    """A profiling session around a block of code: `with gpulab.monitor.profile(out="prof") as p:`.

    `settings` are ProfileConfig fields (interval_s, warmup_steps, kernel_window_steps, ...), plus
    `console` (a rich Console for the printed report) and `quiet=True` to print nothing.
    """
    from gpulab.monitor.session import profile as start_session

    return start_session(out, **settings)


__all__ = ["profile"]
