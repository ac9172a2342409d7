"""`gpulab profile [--out DIR] [--interval S] -- python your_script.py args...`"""

from __future__ import annotations

import argparse

from gpulab.errors import UserError
from gpulab.io import given_path
from gpulab.monitor.config import TRY_MAX_PAIRS, TRY_STEPS, ProfileConfig

_DESCRIPTION = """\
Run an unmodified PyTorch training script and show where its step time goes.

Steps come from optimizer.step() (else from backward() calls); time blocked on the DataLoader
(transforms included), host syncs (.item(), print, .cpu() on CUDA), host-to-device copies,
forward/backward/optimizer and the Python in between is measured per step, in every Python
process of the job, while a sampler records GPU and CPU utilization. DIR receives report.json
(findings ranked by share of step time, each with evidence, the line and the fix),
timeline.png and trace.json (open in ui.perfetto.dev); a file there that gpulab did not write
is never replaced (--force replaces it). The script keeps its exit code, stdout and stderr;
the short report goes to stderr. Signals sent to gpulab are passed on to the script; 5 s later
whatever is left of the job is stopped. A job that stops making progress (a hung
collective) is named on stderr at once - every rank's collective and line - and stopped.

--try KEY=VALUE --steps K measures a change on the first K steps against the script as it is: a
DataLoader setting (num_workers, pin_memory, persistent_workers, prefetch_factor) or torch's
threads (threads=N). The runs alternate, in pairs, until their ratios agree (or --max-pairs).
"""


def add_profile_parser(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="run an unmodified training script and diagnose why the device idles",
        description=_DESCRIPTION,
        usage="gpulab profile [--out DIR [--force]] [--interval S] [--try KEY=VALUE ... --steps K] -- python your_script.py [args ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default profiles/<timestamp>-<script>); "
                   "files there that gpulab did not write are never replaced")
    p.add_argument("--force", action="store_true", help="replace files in DIR that gpulab did not write")
    p.add_argument("--interval", type=float, default=None, metavar="S",
                   help="GPU/CPU sampling interval in seconds (default 0.1)")
    p.add_argument("--try", dest="try_", action="append", default=[], metavar="KEY=VALUE",
                   help="measure a change before making it: run the first --steps steps as the script is and "
                        "with KEY=VALUE forced on its DataLoaders (num_workers, pin_memory, persistent_workers, "
                        "prefetch_factor) or torch's intra-op threads (threads=N), in turn, and compare the step "
                        "times; repeatable")
    p.add_argument("--steps", type=int, default=None, metavar="K", help=f"steps measured per --try run (default {TRY_STEPS})")
    p.add_argument("--max-pairs", type=int, default=None, metavar="N",
                   help="--try runs as-is and changed in turn until the latest pairs' ratios agree within 10%%, "
                        f"at most N pairs (default {TRY_MAX_PAIRS}); then it says the result is not reliable")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the memory window (two steps after warm-up measured for memory; a fixed cost of "
                        "about a tenth of a second plus two slower steps, noticeable in a run of a few seconds)")
    p.add_argument("--hang-after", type=float, default=0.0, metavar="S",
                   help="no process of the job finishing a step or a collective for S seconds is a hang: gpulab "
                        "says where each rank is blocked (collective, sequence number, line) (default: "
                        "max(60 s, 100 x the median step))")
    p.add_argument("--on-hang", choices=("stop", "wait"), default="stop",
                   help="after saying where it hangs: stop the job and write the report (default), or wait")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the Python command to profile, after --")
    p.set_defaults(func=run_profile)


def run_profile(args) -> int:
    from gpulab.monitor.parent.runner import profile_command

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    settings = {"interval_s": args.interval} if args.interval is not None else {}
    cfg = ProfileConfig(**settings, memory_window=not args.no_memory, hang_after_s=args.hang_after,
                        on_hang=args.on_hang)
    out = given_path(args.out)
    if args.try_:
        from gpulab.monitor.parent.trial import try_command

        steps = TRY_STEPS if args.steps is None else args.steps
        max_pairs = TRY_MAX_PAIRS if args.max_pairs is None else args.max_pairs
        return try_command(command, out, cfg, args.try_, steps, max_pairs, force=args.force)
    given = [flag for flag, value in (("--steps", args.steps), ("--max-pairs", args.max_pairs)) if value is not None]
    if given:  # silently ignored, they would look like a setting of the profile
        raise UserError(f"{' and '.join(given)} only {'apply' if len(given) > 1 else 'applies'} with --try: add "
                        f"--try KEY=VALUE to measure a change, or drop {'them' if len(given) > 1 else 'it'}")
    return profile_command(command, out, cfg, force=args.force)
