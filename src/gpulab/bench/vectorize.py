"""vectorize: the utilization seminar's examples, a Python loop vs one call over all the data.

1. One-hot class masks: a segmentation map of 80 classes -> 80 boolean masks (B, 80, H, W).
   A loop over classes issues 80 comparisons; indexing an 80 x 80 identity matrix with the map
   (`eye[seg]`), a broadcast comparison, or `scatter_` build all masks in one call.
2. A loss over images of different sizes: a loop computes each image's mean per-pixel
   cross-entropy separately (B small calls, forward and backward); padding the batch to the
   largest image once and masking the padding computes the same loss in a few large calls.
   Padding costs a copy, done once where batches are assembled (the collate): timed apart.
3. `.contiguous()` after `permute`: a permuted tensor is a view with shuffled strides. An op
   that needs the data in row-major order (a matmul over the last dim, `view`) copies it
   again on every call; one `.contiguous()` copy up front pays once. Elementwise ops do not
   care about layout, so there the extra copy is pure cost: both cases are measured.
Every pair is first checked to give the same values (masks identical; losses and gradients
equal to float tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpulab.bench.harness import measure
from gpulab.bench.result import Column, Result, figure

LESSON = (
    "A Python loop of small operations leaves the device idle between them; indexing, "
    "broadcasting and pad+mask do the same work in a few large calls."
)


@dataclass(kw_only=True)
class Config:
    classes: int = 80
    """One-hot: the seminar's 80 classes."""
    mask_batch: int = 16
    mask_hw: int = 128
    loss_images: int = 16
    loss_classes: int = 10
    loss_min_hw: int = 64
    loss_max_hw: int = 192
    """Each image's height and width are drawn in [min, max]."""
    permute_shape: tuple[int, int, int, int] = (32, 64, 32, 32)
    """(N, C, H, W) permuted to (N, H, W, C)."""
    permute_ops: int = 4
    repeats: int = 7
    min_sample_s: float = 0.05
    max_total_s: float = 3.0


PRESETS = {  # `--preset NAME`: the sizes of each run; "full" is Config's defaults
    "full": {},
    "quick": dict(
        mask_batch=4, mask_hw=64, loss_images=8, loss_min_hw=16, loss_max_hw=64,
        permute_shape=(8, 32, 16, 16), repeats=5, min_sample_s=0.01, max_total_s=0.3,
    ),
    "tiny": dict(
        classes=8, mask_batch=2, mask_hw=8, loss_images=3, loss_min_hw=4, loss_max_hw=9,
        permute_shape=(2, 4, 3, 3), repeats=3, min_sample_s=0.001, max_total_s=0.05,
    ),
}


# ----------------------------------------------------------------------------- 1. one-hot masks


def one_hot_ways(seg: torch.Tensor, classes: int) -> dict:
    """Four ways to turn a (B, H, W) class map into (B, classes, H, W) boolean masks."""
    B, H, W = seg.shape
    eye = torch.eye(classes, dtype=torch.bool, device=seg.device)
    labels = torch.arange(classes, device=seg.device).view(1, classes, 1, 1)

    def loop():
        masks = torch.empty(B, classes, H, W, dtype=torch.bool, device=seg.device)
        for c in range(classes):
            masks[:, c] = seg == c
        return masks

    def index_eye():
        # eye[seg] is (B, H, W, classes); permute is a free view (channels-last layout)
        return eye[seg].permute(0, 3, 1, 2)

    def broadcast():
        return seg.unsqueeze(1) == labels

    def scatter():
        masks = torch.zeros(B, classes, H, W, dtype=torch.bool, device=seg.device)
        return masks.scatter_(1, seg.unsqueeze(1), True)

    return {
        "loop over classes": loop,
        "index identity: eye[seg]": index_eye,
        "broadcast: seg == arange": broadcast,
        "scatter_": scatter,
    }


# ----------------------------------------------------------------------------- 2. padded loss


def variable_batch(cfg: Config, device: torch.device, seed: int = 0):
    """B images of random sizes: logits (K, h, w) and targets (h, w), different h, w per image."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(cfg.loss_min_hw, cfg.loss_max_hw + 1, (cfg.loss_images, 2), generator=g).tolist()
    logits = [torch.randn(cfg.loss_classes, h, w, generator=g).to(device).requires_grad_() for h, w in sizes]
    targets = [torch.randint(0, cfg.loss_classes, (h, w), generator=g).to(device) for h, w in sizes]
    return logits, targets


def pad_batch(logits: list[torch.Tensor], targets: list[torch.Tensor]):
    """Zero-pad to the largest image; the mask marks real pixels. Done once per batch."""
    B, K = len(logits), logits[0].shape[0]
    H = max(x.shape[1] for x in logits)
    W = max(x.shape[2] for x in logits)
    device = logits[0].device
    padded = torch.zeros(B, K, H, W, device=device)
    target = torch.zeros(B, H, W, dtype=torch.long, device=device)
    mask = torch.zeros(B, H, W, dtype=torch.bool, device=device)
    for i, (x, t) in enumerate(zip(logits, targets)):
        h, w = t.shape
        padded[i, :, :h, :w] = x.detach()
        target[i, :h, :w] = t
        mask[i, :h, :w] = True
    return padded.requires_grad_(), target, mask


def loss_loop(logits, targets):
    """Mean over images of each image's mean per-pixel cross-entropy, and its gradients."""
    loss = sum(F.cross_entropy(x.unsqueeze(0), t.unsqueeze(0)) for x, t in zip(logits, targets)) / len(logits)
    return [loss.detach(), *torch.autograd.grad(loss, logits)]


def loss_padded(padded, target, mask):
    """The same loss on the padded batch: padding pixels are masked out of each image's mean."""
    per_pixel = F.cross_entropy(padded, target, reduction="none")  # (B, H, W)
    per_image = (per_pixel * mask).sum((1, 2)) / mask.sum((1, 2))
    loss = per_image.mean()
    return [loss.detach(), *torch.autograd.grad(loss, [padded])]


# ----------------------------------------------------------------------------- 3. contiguity


def permute_ways(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    def linear_on_view():
        y = x.permute(0, 2, 3, 1)  # (N, H, W, C) view: C is no longer the fastest dim
        return [y @ w for w in weights]  # each matmul copies y into row-major order first

    def linear_contiguous():
        y = x.permute(0, 2, 3, 1).contiguous()  # one copy, reused by every matmul
        return [y @ w for w in weights]

    def elementwise_on_view():
        y = x.permute(0, 2, 3, 1)
        return [y * w[0, 0] + 1 for w in weights]  # elementwise kernels follow any strides

    def elementwise_contiguous():
        y = x.permute(0, 2, 3, 1).contiguous()
        return [y * w[0, 0] + 1 for w in weights]

    return {
        "linear over C": {"on the permuted view": linear_on_view, "contiguous() once": linear_contiguous},
        "elementwise": {"on the permuted view": elementwise_on_view, "contiguous() once": elementwise_contiguous},
    }


# ----------------------------------------------------------------------------- the benchmark


def run(cfg: Config, ctx, result: Result) -> None:
    table = result.table(
        "ways",
        "the same result, computed two or more ways (speedup vs the first way of each task)",
        [
            Column("device", "device"),
            Column("task", "task"),
            Column("way", "way"),
            Column("time", "time", "time"),
            Column("speedup", "speedup", "ratio"),
        ],
    )
    if not ctx.gpus():
        result.skip("GPU rows", ctx.no_gpu_reason())
    kw = dict(repeats=cfg.repeats, min_sample_s=cfg.min_sample_s, max_total_s=cfg.max_total_s)
    speedups: dict[str, dict] = {}

    def compare(device, topic: str, task: str, ways: dict, exact: bool):
        results = {name: fn() for name, fn in ways.items()}
        first = next(iter(results))
        for name, value in list(results.items())[1:]:
            # atol far below the smallest values compared (per-pixel gradients are ~1e-6)
            tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-4, atol=1e-8)
            result.check(f"{device} {task}: {name} == {first}", value, results[first], **tol)
        base = None
        for name, fn in ways.items():
            ctx.progress(f"vectorize {device} {task}: {name}")
            t = measure(fn, [device], **kw)
            baseline = base is None  # the first way of each task is the one the others are compared with
            base = base or t.median_s
            table.add(device=str(device), topic=topic, task=task, way=name, time=t, speedup=base / t.median_s, baseline=baseline)
            if not baseline:
                speedups.setdefault(str(device), {})[f"{topic}: {name}"] = base / t.median_s

    for device in ctx.single_devices():
        g = torch.Generator().manual_seed(0)
        seg = torch.randint(0, cfg.classes, (cfg.mask_batch, cfg.mask_hw, cfg.mask_hw), generator=g).to(device)
        compare(device, "one-hot", f"one-hot masks, {cfg.classes} classes", one_hot_ways(seg, cfg.classes), exact=True)

        logits, targets = variable_batch(cfg, device)
        batch = pad_batch(logits, targets)
        loss_task = f"loss+grad over {cfg.loss_images} variable-size images"
        compare(
            device,
            "padded loss",
            loss_task,
            {"loop over images": lambda: loss_loop(logits, targets), "pad + mask": lambda: _padded_as_loop(batch, logits)},
            exact=False,
        )
        t_pad = measure(lambda: pad_batch(logits, targets), [device], **kw)
        table.add(device=str(device), topic="padded loss", task=loss_task, way="(padding, once per batch)", time=t_pad)

        N, C, H, W = cfg.permute_shape
        x = torch.randn(N, C, H, W, generator=g).to(device)
        weights = [torch.randn(C, C, generator=g).to(device) for _ in range(cfg.permute_ops)]
        for task, ways in permute_ways(x, weights).items():
            compare(device, f"contiguous ({task})", f"{cfg.permute_ops}x {task} after permute", ways, exact=False)

    result.note("eye[seg] returns a permuted view (channels-last layout); add .contiguous() if NCHW memory order is needed")
    result.note("x.permute(...).view(-1, C) raises an error; .reshape(-1, C) silently copies on every call")
    result.summary = {"speedup": speedups, "headline": _headline(table.rows)}


def _padded_as_loop(batch, logits):
    """loss_padded, with the gradient cut back to each image's real pixels to compare with the loop."""
    loss, grad = loss_padded(*batch)
    return [loss, *(grad[i, :, : x.shape[1], : x.shape[2]] for i, x in enumerate(logits))]


def _headline(rows: list[dict]) -> str:
    """Per device, the best alternative to each task's first way (below 1x: the first way wins)."""
    parts = []
    for device in dict.fromkeys(r["device"] for r in rows):
        best: dict[str, float] = {}
        for r in rows:
            if r["device"] == device and r.get("baseline") is False:
                best[r["topic"]] = max(best.get(r["topic"], 0.0), r["speedup"])
        parts.append(f"{device}: " + ", ".join(f"{topic} {s:.2f}x" for topic, s in best.items()))
    return "best alternative vs the first way: " + "; ".join(parts)


def plot(result: Result):
    rows = [r for r in (result.tables["ways"].rows if "ways" in result.tables else []) if r.get("speedup") is not None]
    devices = list(dict.fromkeys(r["device"] for r in rows)) or ["(none)"]
    fig, axes = figure(ncols=len(devices), width=6.0, height=4.5)
    for ax, device in zip(axes, devices):
        sel = [r for r in rows if r["device"] == device]
        labels = [f"{r['topic']}\n{r['way']}" for r in sel]
        colors = ["lightgrey" if r.get("baseline") else "tab:green" if r["speedup"] >= 1 else "tab:red" for r in sel]
        bars = ax.barh(range(len(sel)), [r["speedup"] for r in sel], color=colors)
        ax.bar_label(bars, [f"{r['speedup']:.1f}x" for r in sel], fontsize=7)
        ax.set_yticks(range(len(sel)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.axvline(1.0, color="grey", ls=":", lw=1)
        if sel and max(r["speedup"] for r in sel) > 20:
            ax.set_xscale("log")
        ax.set_xlabel("speedup vs the first way of each task (grey; red: slower)")
        ax.set_title(f"vectorize on {device}")
    fig.tight_layout()
    return fig
