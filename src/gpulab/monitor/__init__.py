"""See where the time goes: `profile(out=...)` profiles a training loop in this process (`with ...
as p:`; `p.step()`); `gpulab profile -- python script.py` an unmodified script (parent/runner.py);
`gpulab train --profile` gpulab's own trainer, whose phases (gpulab.train.step.PhaseTimer) the
profiler listens to.

Importing this package imports neither torch (the user's script must be the one that imports it:
it may set OMP_NUM_THREADS first) nor the rest of the profiler (`gpulab train` imports it for
--profile, and a run without it pays nothing).
"""


def profile(out="profile", **settings):
    """A profiling session around a block of code: `with gpulab.monitor.profile(out="prof") as p:`.
    `settings` are ProfileConfig fields (interval_s, warmup_steps, ...), plus `console` (a rich
    Console for the printed report), `quiet=True` to print nothing, and session.Profile's `force`."""
    from gpulab.monitor.session import Profile

    return Profile(out, **settings)


__all__ = ["profile"]
