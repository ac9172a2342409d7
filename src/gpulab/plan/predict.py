"""From one device's step profile and a link's allreduce cost to k devices' step time.

Each rank computes its B/k samples as one device does (the profile at that per-device batch),
then its gradient buckets are all-reduced in bucket order, each one starting when it is ready
(its last gradient landed during backward) and the one before it has finished (collectives on
one communicator run one at a time). What runs past the end of backward is exposed:

    step(k) = step(B/k on one device) + max(0, end of the last bucket's allreduce - end of backward)

Only the exposed part costs time; the rest is hidden behind backward, as `GradSync` and DDP do,
but only as far as the devices let it: until backward ends, an allreduce progresses at
`profile.overlap` times its idle speed (measured: on a CPU, gloo and the network stack share the
cores backward is using; their cost to backward is in that number too), at full speed after.
Assumptions (stated with every plan): ranks are equally fast; one ring over all k devices runs
at the speed of its slowest hop.

Sharded (--shard fsdp, `predict(..., sharded=True)`): each unit's parameters are all-gathered
before its forward and again before its backward, and its gradients reduce-scattered after:
3 x (k-1)/k of the model's bytes per step, in 3 x units collectives. FSDP gathers the next unit
while the current one computes, so only the first gather waits for nothing to hide behind; the
rest progresses at `profile.overlap` times its idle speed while forward and backward compute
(the replicated overlap, measured: an assumption for FSDP's gathers), and what is left is exposed:

    step(k) = step(B/k) + first gather + max(0, rest - overlap x (forward + backward)) + FSDP's cost

FSDP's cost (copying gathered buffers in and out, its hooks; on gloo a reduce-scatter is an
allreduce) is not modelled but measured: on a CPU the plan's copies also run a sharded step
(plan/profile_step.py), and what it took beyond the rest is added at every k and link.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpulab.plan.links import LinkCost
from gpulab.plan.profile import StepProfile

SHARDED_ASSUMPTION = ("--shard fsdp: each unit gathered twice and reduce-scattered once per step; all but the first "
                      "gather overlap forward and backward at the measured share of idle speed; what FSDP cost the copies' "
                      "measured sharded step beyond that (0 where not measured: a GPU) is the same at every k and link")
ASSUMPTIONS = (
    "every device computes its B/k samples as fast as the one measured",
    "gradient buckets are all-reduced in order, each from the moment it is ready; only what runs past backward costs time",
    "during backward, an allreduce progresses at the measured share of its idle speed (1 where not measured: one device per process, as NCCL on GPUs)",
    "one ring over all devices, as fast as its slowest hop (between machines when there are several)",
)


def bucket_schedule(ready_s: list[float], durations_s: list[float], backward_s: float = 0.0,
                    overlap: float = 1.0) -> list[tuple[float, float]]:
    """(start, end) of each bucket's allreduce, seconds after backward began; `durations_s` on
    idle devices, progressing at `overlap` times that speed until backward ends at `backward_s`."""
    schedule, free = [], 0.0
    for ready, duration in zip(ready_s, durations_s):
        start = max(ready, free)
        free = _finish(start, duration, backward_s, overlap)
        schedule.append((start, free))
    return schedule


def _finish(start: float, work_s: float, backward_s: float, rate: float) -> float:
    """When an allreduce of `work_s` (idle seconds) started at `start` ends."""
    if start >= backward_s:
        return start + work_s
    during = rate * (backward_s - start)  # idle seconds' worth done before backward ends
    if work_s <= during:
        return start + work_s / rate
    return backward_s + work_s - during


def fit_overlap(ready_s: list[float], durations_s: list[float], backward_s: float, exposed_s: float) -> float:
    """The share of its idle speed at which communication must progress during backward for the
    bucket schedule to leave `exposed_s` past backward's end (bisection: the exposed time falls
    as the share grows). 0 when even no progress at all exposes less than that; 1 when full
    speed exposes more."""
    def exposed(share: float) -> float:
        return max(0.0, bucket_schedule(ready_s, durations_s, backward_s, share)[-1][1] - backward_s)

    if exposed_s >= exposed(0.0):
        return 0.0
    if exposed_s <= exposed(1.0):
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exposed(mid) > exposed_s else (lo, mid)
    return (lo + hi) / 2


def exposed_communication(profile: StepProfile, link: LinkCost, k: int) -> float:
    """Seconds of allreduce that backward does not hide."""
    if k <= 1 or not profile.bucket_bytes:
        return 0.0
    durations = [link.allreduce_s(nbytes, k) for nbytes in profile.bucket_bytes]
    end = bucket_schedule(profile.bucket_ready_s, durations, profile.backward_s, profile.overlap)[-1][1]
    return max(0.0, end - profile.backward_s)


@dataclass
class Prediction:
    devices: int
    nodes: int
    global_batch: int
    per_device_batch: int
    compute_s: float
    """One device's step at the per-device batch."""
    communication_s: float
    """The whole allreduce of one step, hidden or not."""
    exposed_s: float
    link: str
    memory: dict | None = None
    """The per-device step's measured memory (StepProfile.memory): plan/peak_memory.py predicts from it."""
    sharded_measured: tuple[int, int] | None = None
    """(copies, peak) of a sharded step measured among the profile's copies (StepProfile.sharded_peak)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s

    @property
    def efficiency(self) -> float:
        """Of k devices' ideal speed at this per-device batch: compute / step."""
        return self.compute_s / self.step_s

    @property
    def communication_share(self) -> float:
        return self.exposed_s / self.step_s

    def to_dict(self) -> dict:
        return {
            "devices": self.devices, "nodes": self.nodes, "global_batch": self.global_batch,
            "per_device_batch": self.per_device_batch, "compute_s": self.compute_s,
            "communication_s": self.communication_s, "exposed_s": self.exposed_s, "step_s": self.step_s,
            "samples_per_s": self.samples_per_s, "efficiency": self.efficiency,
            "communication_share": self.communication_share, "link": self.link,
        }


def sharded_communication(profile: StepProfile, link: LinkCost, k: int) -> tuple[float, float]:
    """(all of a sharded step's communication, the part not hidden) in seconds (module docstring)."""
    if k <= 1 or not profile.unit_bytes:
        return 0.0, 0.0
    per_unit = [3 * link.gather_s(nbytes, k) for nbytes in profile.unit_bytes if nbytes > 0]
    total = sum(per_unit)
    first = link.gather_s(next(b for b in profile.unit_bytes if b > 0), k)
    hideable = profile.overlap * (profile.before_backward_s + profile.backward_s)
    return total, first + max(0.0, total - first - hideable)


def fsdp_cost_s(profile: StepProfile, profile_link: LinkCost) -> float:
    """What FSDP cost the measured sharded step beyond the model above, on the link the copies
    were measured over (gathered buffers copied in and out, hooks, gloo's reduce-scatter): the
    measured step less the replicated step and the modelled communication. 0 when not measured."""
    if profile.sharded_step_s is None or profile.copies < 2:
        return 0.0
    return profile.sharded_step_s - profile.step_s - sharded_communication(profile, profile_link, profile.copies)[1]


def predict(profile: StepProfile, link: LinkCost | None, k: int, nodes: int = 1, global_batch: int | None = None,
            sharded: bool = False, profile_link: LinkCost | None = None) -> Prediction:
    """k devices (over `nodes` machines), each at `profile.batch` samples per step; `global_batch`
    when the parts are not all equal (B/k rounded down, some ranks one sample more); `sharded`:
    --shard fsdp's gathers and reduce-scatters instead of the allreduce of gradient buckets, plus
    what FSDP cost the copies' measured sharded step beyond them (fsdp_cost_s; `profile_link`:
    the link the copies were measured over, default `link`): on that link and k the prediction is
    the measured sharded step; elsewhere its communication is repriced."""
    if sharded and link and k > 1:
        communication, exposed = sharded_communication(profile, link, k)
        exposed += fsdp_cost_s(profile, profile_link or link)
    else:
        communication = sum(link.allreduce_s(b, k) for b in profile.bucket_bytes) if link and k > 1 else 0.0
        exposed = exposed_communication(profile, link, k) if link else 0.0
    return Prediction(
        devices=k, nodes=nodes, global_batch=global_batch or profile.batch * k, per_device_batch=profile.batch,
        compute_s=profile.expected_slowest_s(max(1, k // profile.copies)), communication_s=communication,
        exposed_s=exposed, link=link.source if link and k > 1 else "none", memory=profile.memory,
        sharded_measured=(profile.copies, profile.sharded_peak) if profile.sharded_peak else None,
    )
