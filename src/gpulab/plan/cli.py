"""`gpulab plan`: the command line over gpulab.plan."""

from __future__ import annotations

import datetime
import math
from pathlib import Path

from gpulab.errors import UserError, sigterm_raises

CHECK_LINKS = "1000,200"  # Mbit/s of the 2-host check's links
CHECK_ROUNDS = 3


def add_plan_parser(sub) -> None:
    from gpulab.options import STEP_FIELDS, add_config_options

    p = sub.add_parser(
        "plan", help="predict whether k devices or n machines would make this training faster, from measurements",
        description="Measure one training step and the allreduce here, predict k devices / n machines, "
        "and with --check compare the prediction with real runs on this machine.",
    )
    add_config_options(p, STEP_FIELDS)
    p.add_argument("--devices-per-node", type=int, nargs="+", default=[1, 2], metavar="K",
                   help="devices per machine to plan for (default: 1 2)")
    p.add_argument("--nodes", type=int, nargs="+", default=[1], metavar="N", help="machines to plan for (default: 1)")
    p.add_argument("--link", default=None,
                   help="what joins the machines: 10gbe, 25gbe, 100gbe, ndr400, nvlink4, pcie4, pcie5, or GB/s,us")
    p.add_argument("--device-link", default=None,
                   help="what joins the devices of one machine (default: measured here between 2 ranks)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds of steps per measured profile (default 3)")
    p.add_argument("--no-sweep", action="store_true", help="skip the per-device batch sweep (faster)")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="memory per device to plan within, e.g. 80GiB, 16GB, 512MiB (default: this GPU's, or this "
                        "machine's shared by its ranks)")
    p.add_argument("--check", action="store_true",
                   help="also run what fits on this machine (1 process, 2 ranks, 2 agents, 2 tc-limited hosts) "
                   "and compare predicted with measured samples/s")
    p.add_argument("--check-links", default=None, metavar="MBIT,...",
                   help=f"link rates of the 2-host check, Mbit/s (default {CHECK_LINKS})")
    p.add_argument("--rounds", type=int, default=None, help=f"rounds of the check (default {CHECK_ROUNDS}; the median counts)")
    p.add_argument("--out", default=None, help="folder for plan.json and plan.png (default plans/<timestamp>-<model>); "
                   "files there that gpulab did not write are never replaced")
    p.add_argument("--force", action="store_true", help="replace files in the --out folder that gpulab did not write")
    p.set_defaults(func=run_plan)


def run_plan(args) -> int:
    with sigterm_raises():  # its temporary folders and measuring processes go with it
        return _run_plan(args)


def _run_plan(args) -> int:
    from rich.console import Console

    from gpulab.models import check_named
    from gpulab.options import STEP_FIELDS, given_options
    from gpulab.io import OutputFolder, check_writable, given_path, writing_results
    from gpulab.plan import render
    from gpulab.plan.peak_memory import parse_memory
    from gpulab.plan.planner import PlanConfig, device_kind, make_plan
    from gpulab.train import TrainConfig

    given = given_options(args, STEP_FIELDS)
    check_named(given.get("model"))
    checked = TrainConfig(**given)  # every train option checked the way gpulab train checks it
    train = {**given, "model": checked.model, "batch_size": checked.batch_size}
    cfg = PlanConfig(train=train, devices_per_node=args.devices_per_node, nodes=args.nodes, link=args.link,
                     device_link=args.device_link, profile_seconds=args.seconds, sweep=not args.no_sweep,
                     memory=parse_memory(args.memory) if args.memory is not None else None)
    check_options_used(args, cfg)
    rates = parse_rates(args.check_links or CHECK_LINKS)
    rounds = CHECK_ROUNDS if args.rounds is None else args.rounds
    if rounds < 1:
        raise UserError(f"--rounds {rounds}: run the check at least once")
    if args.check and device_kind(train) != "cpu":
        raise UserError("plan --check runs the CPU configurations this machine can run: add --devices cpu")
    if args.check and train["batch_size"] < 2:
        raise UserError(f"--batch-size {train['batch_size']}: --check runs 2 ranks, each on half the batch; "
                        "use a batch of 2 or more")
    out = given_path(args.out) or Path(f"plans/{datetime.datetime.now():%Y%m%d-%H%M%S}-{train['model'].replace(':', '-')}")
    outputs = OutputFolder.out(out, args.force)
    check_writable(out)
    outputs.check(render.OUTPUTS)  # before the measurements
    console = Console(highlight=False)
    say = lambda text: console.print(f"[dim]{text}[/dim]")  # noqa: E731
    plan = make_plan(cfg, say)
    console.print(render.table(plan))
    for line in [*render.noise(plan), *render.verdict(plan), *render.memory_verdict(plan)]:
        console.print(line)
    console.print("Assumptions: " + "; ".join(render.assumptions(plan)) + ".", style="dim")
    checked, memory_checked = None, None
    if args.check:
        from gpulab.plan.check import check

        checked, memory_checked = check(train, rates, rounds=rounds, profile_seconds=args.seconds, say=say)
        console.print(check_table(checked))
        console.print(memory_check_table(memory_checked))
    with writing_results():  # a full disk: one line; each file is whole or absent
        render.write(plan, outputs, checked, memory_checked)
    console.print(f"wrote {out / 'plan.json'} and {out / 'plan.png'}")
    return 0


def check_options_used(args, cfg) -> None:
    """An option that would change nothing in this plan is refused, not ignored."""
    if not args.check:
        for option, value in (("--rounds", args.rounds), ("--check-links", args.check_links)):
            if value is not None:
                raise UserError(f"{option} sets the check's runs: add --check, or leave {option} out")
    if cfg.link is not None and max(cfg.nodes) == 1:
        raise UserError(f"--link {cfg.link} says what joins machines, and this plan is for one: add --nodes 2 "
                        "(or more), or leave --link out")
    if cfg.device_link is not None and max(cfg.devices_per_node) == 1:
        raise UserError(f"--device-link {cfg.device_link} says what joins the devices of a machine, and this plan "
                        "has one per machine: add --devices-per-node 2 (or more), or leave --device-link out")


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise UserError(f"--check-links {text}: give link rates in Mbit/s, e.g. 1000,200")
    return rates


def memory_check_table(memory: dict):
    from rich.table import Table

    from gpulab.memory.categories import size

    t = Table(title="peak memory per device: predicted vs measured (gpulab train --profile, rank 0)")
    for name in ("configuration", "per-device batch", "predicted", "measured", "error"):
        t.add_column(name, justify="right")
    for r in memory["setups"]:
        t.add_row(r["name"], str(r["per_device_batch"]), size(r["predicted_peak"]), size(r["measured_peak"]),
                  f"{r['error']:+.1%}")
    fit, over = memory["runs"]
    t.caption = (f"within {size(memory['budget'])} the plan says batch {fit['batch']} fits: measured "
                 f"{size(fit['peak'])} ({'fits' if fit['fits'] else 'does NOT fit'}); batch {over['batch']}: "
                 f"{size(over['peak'])} ({'does not fit' if not over['fits'] else 'FITS'})")
    return t


def check_table(rows: list[dict]):
    from rich.table import Table

    t = Table(title="the model checked: predicted from profiles taken beside each run (before and after it, on the "
                    "machine as it was) vs measured; median over rounds")
    for name in ("configuration", "predicted samples/s", "measured samples/s", "error", "rounds' errors", "nominal link"):
        t.add_column(name, justify="right")
    for r in rows:
        nominal = r["nominal_link_predicted_samples_per_s"]
        t.add_row(r["name"], f"{r['predicted_samples_per_s']:,.0f}", f"{r['measured_samples_per_s']:,.0f}",
                  f"{r['error']:+.1%}", " ".join(f"{e:+.0%}" for e in r["round_errors"]),
                  f"{nominal:,.0f} ({nominal / r['measured_samples_per_s'] - 1:+.0%})" if nominal else "-")
    return t
