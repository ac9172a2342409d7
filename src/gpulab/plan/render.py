"""The plan, said: a table, a verdict in words, plan.json and plan.png (written atomically)."""

from __future__ import annotations

import datetime
import io
import statistics

from gpulab.io import OutputFolder, git_commit, json_bytes
from gpulab.plan.planner import TARGET_EFFICIENCY, Plan
from gpulab.memory.categories import CATEGORY_NAMES, size
from gpulab.plan.peak_memory import replicated_peak, sharded_peak, sync_of
from gpulab.plan.predict import ASSUMPTIONS, SHARDED_ASSUMPTION

OUTPUTS = ("plan.json", "plan.png")  # what write() puts in --out


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def table(plan: Plan):
    from rich.table import Table

    t = Table(title=f"{plan.config.train['model']}, global batch {plan.one_device.global_batch}, "
                    f"one device = {describe_device(plan)}",
              caption="measured here: compute and memory at each per-device batch; predicted from them and the "
                      "link: allreduce, exposed, step, samples/s, speedup, efficiency, 90% from batch")
    for name in ("machines x devices", "per-device batch", "compute ms", "allreduce ms", "exposed ms", "step ms",
                 "samples/s", "speedup", "efficiency", "90% from batch", "memory / device"):
        t.add_column(name, justify="right")
    for row, speedup in zip(plan.rows, plan.speedups):
        per_node = row.devices // row.nodes
        efficient = plan.smallest_efficient_batch(row.nodes, per_node) if row.devices > 1 else None
        t.add_row(
            f"{row.nodes} x {per_node}", str(row.per_device_batch), ms(row.compute_s), ms(row.communication_s),
            ms(row.exposed_s), ms(row.step_s), f"{row.samples_per_s:,.0f}", f"{speedup:.2f}x",
            f"{row.efficiency:.0%}" if row.devices > 1 else "-",
            "-" if row.devices == 1 or not plan.sweep else (f"{efficient:,}" if efficient else f"> {last_swept(plan, row):,}"),
            size(replicated_peak(row.memory, sync(plan))) if row.memory else "-",
        )
    return t


def sync(plan: Plan) -> str:
    return sync_of(plan.config.train)


def memory_rows(plan: Plan) -> list[dict]:
    """Per configuration with a measured step: its peak per device replicated and sharded, the
    budget, and the largest batch per device that fits it each way (None without a fitted line)."""
    line, rows = plan.memory_line, []
    for row in plan.rows:
        if not row.memory:
            continue
        budget, source = plan.memory_budget(row.devices // row.nodes)
        replicated = replicated_peak(row.memory, sync(plan))
        sharded = sharded_peak(row.memory, row.devices, row.sharded_measured) if row.devices > 1 else None
        rows.append({
            "devices": row.devices, "nodes": row.nodes, "per_device_batch": row.per_device_batch,
            "measured": row.memory, "replicated_peak": replicated, "sharded_peak": sharded,
            "sharded_measured": row.sharded_measured is not None,
            "budget": budget, "budget_source": source,
            "train_samples": plan.profiles[0].train_samples,
            "largest_batch": line.largest_batch(budget, replicated - row.memory["peak"]) if line else None,
            "sharded_largest_batch": (line.largest_batch(budget, sharded - row.memory["peak"])
                                      if line and sharded is not None else None),
        })
    return rows


def memory_verdict(plan: Plan) -> list[str]:
    """Per configuration: the peak per device, what it is made of, the largest batch that fits
    the budget, and what sharding would free."""
    lines = []
    for r in memory_rows(plan):
        parts = sorted(r["measured"]["at_peak"].items(), key=lambda kv: kv[1], reverse=True)[:3]
        what = ("one device" if r["devices"] == 1
                else f"{r['devices']} devices ({'DDP' if sync(plan) == 'ddp' else 'gpulab sync'})")
        text = (f"memory, {what}: {size(r['replicated_peak'])} per device at batch {r['per_device_batch']} ("
                + ", ".join(f"{CATEGORY_NAMES[k]} {size(v)}" for k, v in parts) + ")")
        within = f"{size(r['budget'])} ({r['budget_source']})"
        if plan.memory_line is not None:
            text += (f"; within {within} {fits_up_to(r['largest_batch'], r)} (torch's tensors; "
                     "the process's own memory comes on top)" if r["largest_batch"]
                     else f"; it does not fit in {within} at any batch")
        if r["sharded_peak"] is not None:
            how = ("FSDP's buffers as measured between the copies" if r["sharded_measured"] else
                   "a lower bound: FSDP's own gather and reduce-scatter buffers are not counted")
            saved = r["replicated_peak"] - r["sharded_peak"]
            text += (f"; sharded over {r['devices']} (FSDP / ZeRO-3) {size(r['sharded_peak'])} ({how}): "
                     f"{size(abs(saved))} {'less' if saved >= 0 else 'more'}")
            if plan.memory_line is not None:
                text += f", {fits_up_to(r['sharded_largest_batch'], r)}"
        lines.append(text + ".")
    if plan.memory_line is not None:
        lines.append(f"memory grows by {size(plan.memory_line.per_sample)} per sample per device (fitted through "
                     f"{plan.memory_line.points} measured batch size{'s' if plan.memory_line.points > 1 else ''}).")
    return lines


def fits_up_to(largest: int, row: dict) -> str:
    """"it fits up to batch N per device", or, where N is more than a device's share of the training
    set, that every batch fits: a larger one is none a run could take."""
    total, k = row["train_samples"], row["devices"]
    if not total or largest * k < total:
        return f"it fits up to batch {largest:,} per device"
    if k == 1:
        return f"it fits every batch, the whole training set ({total:,} images) included"
    return (f"it fits every batch, a device's share of the whole training set ({-(-total // k):,} of "
            f"{total:,} images) included")


def memory_json(plan: Plan) -> dict | None:
    line = plan.memory_line
    if line is None:
        return None
    return {"fixed_bytes": line.fixed, "bytes_per_sample": line.per_sample, "fitted_points": line.points,
            "rows": memory_rows(plan)}


def last_swept(plan: Plan, row) -> int:
    points = plan.sweep.get((row.nodes, row.devices // row.nodes), [])
    return points[-1].prediction.per_device_batch if points else row.per_device_batch


def describe_device(plan: Plan) -> str:
    p = plan.profiles[0]
    return f"{p.device}" + (f" ({p.threads} threads)" if plan.kind == "cpu" else "")


def verdict(plan: Plan) -> list[str]:
    """What the numbers say, in words: for each configuration, does it pay, and if not, when would it."""
    lines = []
    for row, speedup in zip(plan.rows, plan.speedups):
        if row.devices == 1:
            continue
        per_node = row.devices // row.nodes
        what = f"{row.devices} devices" + (f" on {row.nodes} machines" if row.nodes > 1 else "")
        if speedup > 1:
            head = f"{what}: {speedup:.2f}x the speed of one at batch {row.global_batch} - it pays"
        else:
            head = f"{what}: {speedup:.2f}x the speed of one at batch {row.global_batch} - too small to pay"
        if speedup > row.devices:  # more than k devices can give: say what the measurements did
            head += (f" (more than {row.devices}x: {row.per_device_batch} samples measured {ms(row.compute_s)} ms, under "
                     f"1/{row.devices} of one device's {ms(plan.one_device.compute_s)} ms for {row.global_batch} - a "
                     "smaller batch's better use of the caches, or noise in the measurements: rerun with more "
                     "--seconds, or measure it with --check)")
        why = (f"communication not hidden by backward is {row.communication_share:.0%} of the step"
               f" ({ms(row.exposed_s)} of {ms(row.step_s)} ms)")
        ideal = plan.one_device.compute_s / row.devices
        if row.compute_s > 1.2 * ideal:
            why += (f"; computing {row.per_device_batch} samples takes {ms(row.compute_s)} ms where 1/{row.devices} "
                    f"of one device's {ms(plan.one_device.compute_s)} ms would be {ms(ideal)}")
            if plan.kind == "cpu" and row.nodes == 1:
                why += " (the ranks share this machine's cores)"
        pays = plan.smallest_paying_batch(row.nodes, per_node)
        efficient = plan.smallest_efficient_batch(row.nodes, per_node)
        when = []
        if speedup <= 1 and plan.sweep:
            when.append(f"it would pay from a global batch of {pays:,}" if pays else
                        f"it does not pay at any batch measured (up to {last_swept(plan, row) * row.devices:,})")
        if efficient:
            when.append(f"{TARGET_EFFICIENCY:.0%} efficiency from {efficient:,} samples per device")
        lines.append(f"{head}: {why}" + (f"; {', '.join(when)}" if when else "") + ".")
    return lines


NOISY = 1.5  # a profile whose mean step is this many times its median met a busy machine


def noise(plan: Plan) -> list[str]:
    """The profiles whose steps a busy machine spread out: the predictions built on them are
    uncertain, whatever their digits."""
    lines = []
    for p in plan.profiles:
        times = sorted(p.step_times_s)
        middle = statistics.median(times) if times else 0.0
        if middle > 0 and p.step_s > NOISY * middle:
            lines.append(f"noisy measurement: at batch {p.batch} ({p.copies} at once) the {len(times)} steps took "
                         f"{ms(times[0])}-{ms(times[-1])} ms (median {ms(middle)}, mean {ms(p.step_s)}): something else "
                         "used the cores, and what is predicted from it is uncertain - rerun on a quiet machine or with "
                         "more --seconds.")
    return lines


def assumptions(plan: Plan) -> list[str]:
    links = [f"{where} link: {link.source}, alpha {link.alpha_s * 1e6:,.1f} us per ring step, "
             f"{link.bandwidth_gbps:,.3g} GB/s" for where, link in plan.links.items()]
    shares = sorted(p.overlap for p in plan.profiles if p.copies > 1)
    if shares:
        span = f"{shares[0]:.0%}" if shares[0] == shares[-1] else f"{shares[0]:.0%}-{shares[-1]:.0%}"
        links.append(f"measured here: during backward an allreduce progresses at {span} of its idle speed "
                     f"(ranks sharing this machine's cores)")
    return [*links, *ASSUMPTIONS, *([SHARDED_ASSUMPTION] if plan.config.sharded else [])]


def to_json(plan: Plan, check: list[dict] | None = None, memory_check: dict | None = None) -> dict:
    return {
        "git_commit": git_commit(),  # the code that measured this ('+dirty': not a clean checkout)
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": {"train": plan.config.train, "devices_per_node": plan.config.devices_per_node, "nodes": plan.config.nodes,
                   "link": plan.config.link, "device_link": plan.config.device_link},
        "device": describe_device(plan),
        "one_device": plan.one_device.to_dict(),
        "rows": [{**r.to_dict(), "speedup": s} for r, s in zip(plan.rows, plan.speedups)],
        "sweep": [{"nodes": n, "devices_per_node": k, "points": [{**p.prediction.to_dict(), "speedup": p.speedup} for p in pts]}
                  for (n, k), pts in plan.sweep.items()],
        "links": {w: {"alpha_s": l.alpha_s, "beta_s_per_byte": l.beta_s_per_byte, "source": l.source} for w, l in plan.links.items()},
        "profiles": [p.to_dict() for p in plan.profiles],
        "noise": noise(plan),
        "verdict": verdict(plan),
        "memory": memory_json(plan),
        "memory_verdict": memory_verdict(plan),
        "assumptions": assumptions(plan),
        "check": check,
        "memory_check": memory_check,
    }


def write(plan: Plan, out: OutputFolder, check: list[dict] | None = None, memory_check: dict | None = None) -> None:
    """plan.json, then plan.png, each atomically, over no file gpulab did not write."""
    out.write({"plan.json": json_bytes(to_json(plan, check, memory_check)), "plan.png": figure(plan, check)})


def figure(plan: Plan, check: list[dict] | None) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Without a batch sweep (--no-sweep) there is nothing for a second panel to show.
    fig, axes = plt.subplots(1, 2 if plan.sweep else 1, figsize=(11 if plan.sweep else 6, 4.2), squeeze=False)
    left = axes[0][0]
    by_nodes: dict[int, list] = {}
    for row in plan.rows:
        by_nodes.setdefault(row.nodes, []).append(row)
    for nodes, rows in sorted(by_nodes.items()):
        left.plot([r.devices for r in rows], [r.efficiency for r in rows], marker="o",
                  label=f"predicted, {nodes} machine{'s' if nodes > 1 else ''}")
    for i, point in enumerate(check or []):
        # Each check setup: its predicted efficiency (circle) and the measured one (cross), same colour;
        # a small sideways offset keeps setups with the same k apart.
        x = point["devices"] + 0.04 * (i - (len(check) - 1) / 2)
        colour = f"C{i + 1}"
        left.scatter([x], [point["predicted_samples_per_s"] / point["ideal_samples_per_s"]], marker="o",
                     facecolors="none", edgecolors=colour, s=50, zorder=3)
        left.scatter([x], [point["measured_samples_per_s"] / point["ideal_samples_per_s"]], marker="x", color=colour,
                     s=60, zorder=3, label=f"{point['name']}: predicted (o), measured (x)")
    left.axhline(TARGET_EFFICIENCY, color="grey", linestyle=":", linewidth=1)
    left.set_xticks(sorted({r.devices for r in plan.rows} | {p["devices"] for p in check or []}))
    left.set_xlabel("devices k")
    left.set_ylabel("scaling efficiency (compute / step)")
    # A run faster than its prediction measures above 1: keep it in view.
    shown = [p[key] / p["ideal_samples_per_s"] for p in check or [] for key in ("predicted_samples_per_s", "measured_samples_per_s")]
    left.set_ylim(0, max([1.05, *(v + 0.05 for v in shown)]))
    left.set_title(f"global batch {plan.one_device.global_batch}")
    left.legend(fontsize=7)
    if plan.sweep:
        _plot_sweep(axes[0][1], plan)
    fig.suptitle(f"gpulab plan: {plan.config.train['model']}, one device = {describe_device(plan)}")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _plot_sweep(right, plan: Plan) -> None:
    for (nodes, per_node), points in plan.sweep.items():
        right.plot([p.prediction.per_device_batch for p in points], [p.prediction.efficiency for p in points], marker="o",
                   label=f"{nodes} x {per_node} devices")
    right.axhline(TARGET_EFFICIENCY, color="grey", linestyle=":", linewidth=1, label=f"{TARGET_EFFICIENCY:.0%}")
    right.set_xscale("log", base=2)
    right.set_xlabel("samples per device per step")
    right.set_ylabel("scaling efficiency (predicted)")
    right.set_ylim(0, 1.05)
    right.set_title("efficiency by per-device batch")
    right.legend(fontsize=7)
