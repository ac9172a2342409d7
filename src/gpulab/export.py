"""`gpulab export RUN_DIR`: a trained run's model as ONNX, verified with onnxruntime.

The model is rebuilt from the run's config.json (`gpulab.models.build(cfg.model)`), its weights
loaded from checkpoint.pt, and exported in eval mode, fp32, with a dynamic batch dimension by
`torch.onnx.export` (the torch.export-based exporter, `dynamo=True`; the TorchScript exporter
only if that one fails) at opset `OPSET`. The export is kept in memory and checked before
anything is written:

- a run on Fashion-MNIST: the whole test set, prepared by the trainer's own `DeviceLoader`
  (same normalisation), through PyTorch and through onnxruntime (CPUExecutionProvider): max
  |logit difference| and both test accuracies, which must be equal;
- a run on the caller's own data (`data == "custom"`, no test set in the run directory):
  `RANDOM_INPUTS` random inputs of the input shape, logit difference only.

Only when the check passes are `<out>` and `<out>.json` (the numbers) written, together and
atomically (gpulab.io): a failed export, check or write leaves no file behind and an older pair
as it was. Files there that gpulab did not write are not replaced (refused before the export)
unless `force`. Exit codes (cli): 0 verified, 1 verification failed, 2 bad input or the `onnx`
extra missing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpulab import models
from gpulab.errors import UserError
from gpulab.io import OutputFolder, cannot_create_in, given_path, json_bytes, not_writable
from gpulab.train.rundir import (CHECKPOINT, LOCK, RUN_FILES, RunDir, Trust, has_lock_file, parse_config,
                                 read_sharded_model)

FORMATS = ("onnx",)
OPSET = 18
"""The opset the torch.export-based exporter's operator library is written in (no conversion
step); onnxruntime has run it since 1.14."""
TOLERANCE = 1e-3
"""Largest max |logit difference| (fp32) between PyTorch and onnxruntime that passes."""
RANDOM_INPUTS = 256
DEFAULT_INPUT_SHAPE = (1, 28, 28)
EXTRA_HINT = "pip install 'gpulab[onnx]'"
INPUT_NAME, OUTPUT_NAME = "images", "logits"


class VerificationFailed(Exception):
    """onnxruntime's outputs differ from PyTorch's beyond the tolerance (nothing was written)."""


def report_path(out: Path) -> Path:
    """Where the verification numbers go: model.onnx -> model.onnx.json."""
    return out.with_name(out.name + ".json")


def require_onnx() -> dict[str, str]:
    """The versions of the optional packages, or one line naming the extra to install."""
    import importlib

    versions = {}
    missing = []
    for name in ("onnx", "onnxscript", "onnxruntime"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            missing.append(name)
    if missing:
        raise UserError(f"gpulab export needs {', '.join(missing)}: {EXTRA_HINT}")
    return versions


# ----------------------------------------------------------------------------- inputs


def check_out(out: Path) -> None:
    """Fail before any work if `out` cannot be written as a file."""
    if out.is_dir():
        raise UserError(f"--out {out} is a directory: give a file name, e.g. {out / 'model.onnx'}")
    parent = out.parent
    if not parent.exists():
        raise UserError(f"--out {out}: folder {parent} does not exist; create it or choose another --out")
    if not parent.is_dir():
        raise UserError(f"--out {out}: {parent} is a file, not a folder; choose another --out")
    if (refused := cannot_create_in(parent)) is not None:
        raise UserError(f"--out {out}: {not_writable(parent, refused, 'choose another --out')}")
    taken = next((name for name in (out.name, report_path(out).name) if name in (*RUN_FILES, LOCK)), None)
    if taken and has_lock_file(parent):  # --force would replace the run itself
        raise UserError(f"--out {out}: {parent / taken} is a file of the run in {parent}, never replaced by an "
                        f"export: choose another name, e.g. {parent / 'model.onnx'}")


def output_folder(out: Path, force: bool) -> OutputFolder:
    """Where `out` and `out`.json go, replacing only what gpulab wrote there (unless `force`)."""
    return OutputFolder(out.parent, f"--out {out}: its folder", fix="choose another --out", force=force)


def load_run(run_dir: Path, trust: Trust = Trust()):
    """(TrainConfig, model state dict, epoch) of a run directory, with one-line errors."""
    run = RunDir(run_dir, trust=trust)  # named on its own: its errors start with the folder
    run.check_is_run()
    cfg = parse_config(run.trusted_config(), run.label)
    checkpoint = run.load_checkpoint()
    state = checkpoint.get("strategy")
    if isinstance(state, dict) and isinstance(state.get("shards"), str):  # --shard fsdp: gathered here
        if cfg.model == models.OBJECT:
            raise UserError(f"{run_dir}: a sharded run of a model passed to train() as an object: its shards are "
                            "read into the model's own shapes, which the run directory cannot rebuild")
        weights = read_sharded_model(run.path / state["shards"], models.build(cfg.model).state_dict(), trust.checkpoint)
        return cfg, weights, checkpoint.get("epoch")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise UserError(f"{run_dir}: {CHECKPOINT} holds no model weights; it is not a gpulab checkpoint")
    return cfg, state["model"], checkpoint.get("epoch")


def input_shape_of(cfg) -> tuple[int, ...]:
    """Per-sample input shape (no batch dim): the config's `input_shape` when it has one."""
    shape = getattr(cfg, "input_shape", None)
    if shape is None:
        return DEFAULT_INPUT_SHAPE
    if not isinstance(shape, (list, tuple)) or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise UserError(f"config.json: input_shape {shape!r} is not a list of positive sizes (without the batch)")
    return tuple(shape)


def load_model(cfg, weights: dict, run_dir: Path, model: torch.nn.Module | None = None) -> torch.nn.Module:
    """The run's model with the checkpoint's weights: rebuilt from its spec, or `model` (an
    instance of the same architecture, for a run whose model was passed to train() as an object)."""
    if model is None:
        if cfg.model == getattr(models, "OBJECT", "custom"):
            raise UserError(
                f"{run_dir}: this run's model was passed to train() as an object, so it cannot be rebuilt from the "
                "run directory: export it from Python with gpulab.export.export(run_dir, model=<a new instance>)"
            )
        model = models.build(cfg.model)
    model = model.cpu()
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:  # the weights belong to another model (or another version of it)
        # torch's message is a header ("Error(s) in loading state_dict for LeNet:") and a line per key
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
        first = lines[1] if lines[0].endswith(":") and len(lines) > 1 else lines[0]
        raise UserError(f"{run_dir}: the checkpoint's weights do not fit model {cfg.model} ({first})") from None
    unfinite = next((name for name, value in model.state_dict().items()
                     if value.is_floating_point() and not torch.isfinite(value).all()), None)
    if unfinite is not None:  # gpulab train keeps no diverged epoch: this checkpoint was altered
        raise UserError(f"{run_dir}: the checkpoint's {unfinite} holds NaN or infinite values, so the model's "
                        "outputs are not numbers: export a checkpoint of a run that did not diverge")
    return model.float().eval()


# ----------------------------------------------------------------------------- export


@contextlib.contextmanager
def _quiet_exporter():
    """The exporter's progress lines, deprecation warnings and 'torchvision is not installed' log
    lines are noise here: gpulab prints its own summary (errors still raise)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        logger.setLevel(level)


def _export_dynamo(model: torch.nn.Module, example: torch.Tensor) -> bytes:
    program = torch.onnx.export(
        model, (example,), None, dynamo=True, opset_version=OPSET, input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME], dynamic_shapes=({0: torch.export.Dim("batch")},), external_data=False,
        verbose=False,
    )
    return program.model_proto.SerializeToString()


def _export_torchscript(model: torch.nn.Module, example: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.onnx.export(
        model, (example,), buf, dynamo=False, opset_version=OPSET, input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME], dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
    )
    return buf.getvalue()


EXPORTERS = {"torch.export (dynamo=True)": _export_dynamo, "torchscript (dynamo=False)": _export_torchscript}


def export_onnx(model: torch.nn.Module, input_shape: tuple[int, ...]) -> tuple[bytes, str]:
    """(the ONNX model as bytes, the exporter that made it). The example batch has 2 samples:
    torch.export would specialise a batch of 1."""
    example = torch.zeros(2, *input_shape)
    errors = []
    for name, export in EXPORTERS.items():
        try:
            with _quiet_exporter(), torch.no_grad():
                return export(model, example), name
        except Exception as e:  # the exporters raise many types; the first line names the cause
            lines = str(e).strip().splitlines()
            errors.append(f"{name}: {lines[0] if lines else type(e).__name__}")
    raise UserError(f"torch.onnx.export could not export this model ({'; '.join(errors)})")


# ----------------------------------------------------------------------------- verify


@dataclass
class Comparison:
    n: int = 0
    max_abs_diff: float = 0.0
    correct_torch: int = 0
    correct_ort: int = 0
    argmax_disagreements: int = 0

    def add(self, torch_logits: np.ndarray, ort_logits: np.ndarray, labels: np.ndarray | None) -> None:
        if torch_logits.shape != ort_logits.shape:
            raise VerificationFailed(f"onnxruntime returned logits of shape {ort_logits.shape}, PyTorch {torch_logits.shape}")
        self.n += len(torch_logits)
        diff = np.abs(torch_logits.astype(np.float64) - ort_logits.astype(np.float64))
        self.max_abs_diff = max(self.max_abs_diff, float(diff.max()) if diff.size else 0.0)
        if not np.isfinite(diff).all():
            self.max_abs_diff = float("inf")
        a, b = torch_logits.argmax(1), ort_logits.argmax(1)
        self.argmax_disagreements += int((a != b).sum())
        if labels is not None:
            self.correct_torch += int((a == labels).sum())
            self.correct_ort += int((b == labels).sum())


def ort_session(model_bytes: bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def eval_batches(cfg):
    """The run's test set as the trainer evaluates it: Fashion-MNIST through DeviceLoader (on the
    CPU, the run's normalisation), in batches of the run's eval batch size."""
    from gpulab import data

    _, test = data.load(cfg.data_dir, download=True)
    return data.DeviceLoader(test, cfg.eval_batch_size, torch.device("cpu"), normalize=cfg.recipe_spec.normalize)


def random_batches(input_shape: tuple[int, ...], n: int = RANDOM_INPUTS, batch: int = 64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, *input_shape, generator=generator)
    return [(X[i:i + batch], None) for i in range(0, n, batch)]


def compare(model: torch.nn.Module, session, batches) -> Comparison:
    result = Comparison()
    with torch.no_grad():
        for X, y in batches:
            X = X.float().contiguous()
            ours = model(X).numpy()
            try:
                theirs = session.run([OUTPUT_NAME], {INPUT_NAME: X.numpy()})[0]
            except Exception as e:  # onnxruntime's errors (e.g. a batch size the model fixed)
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise VerificationFailed(f"onnxruntime failed on a batch of {len(X)} ({first})") from None
            result.add(ours, theirs, None if y is None else y.numpy())
    return result


# ----------------------------------------------------------------------------- the command


def export(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, fmt: str = "onnx",
           model: torch.nn.Module | None = None, say=print, force: bool = False, trust: Trust = Trust()) -> dict:
    """Export the run in `run_dir` to `out` (default RUN_DIR/model.onnx), verify it, write
    `out` and `out`.json. `model`: a fresh instance of the run's architecture, needed only when
    the run's model was passed to train() as an object (the checkpoint's weights are loaded into
    it). `force`: replace `out` or `out`.json where gpulab did not write them. `trust`: what the
    caller vouches for in the run directory (its model's import path; a sharded checkpoint read
    with torch's own reader). Returns the report
    (what the JSON holds); raises UserError for bad input and VerificationFailed (nothing
    written) when onnxruntime disagrees with PyTorch."""
    t_start = time.perf_counter()
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: unknown format; choose {', '.join(FORMATS)}")
    versions = require_onnx()
    run_dir = Path(run_dir)
    out = given_path(out, what="a file name") or run_dir / "model.onnx"
    cfg, weights, epoch = load_run(run_dir, trust)
    check_out(out)
    outputs = output_folder(out, force)
    outputs.check([out.name, report_path(out).name])  # before the export and its check (seconds)
    input_shape = input_shape_of(cfg)
    model = load_model(cfg, weights, run_dir, model)

    t0 = time.perf_counter()
    model_bytes, exporter = export_onnx(model, input_shape)
    export_seconds = time.perf_counter() - t0
    shape_text = "x".join(map(str, input_shape))
    name = type(model).__name__ if cfg.model == getattr(models, "OBJECT", "custom") else cfg.model
    say(f"exported {name} from {run_dir} (epoch {epoch}): ONNX opset {OPSET}, input {INPUT_NAME} "
        f"[batch, {', '.join(map(str, input_shape))}] (dynamic batch), fp32, {exporter}, {export_seconds:.1f} s")

    t0 = time.perf_counter()
    try:
        session = ort_session(model_bytes)
    except Exception as e:
        raise VerificationFailed(f"onnxruntime cannot load the exported model ({str(e).strip().splitlines()[0]})") from None
    custom = cfg.data == "custom"
    batches = random_batches(input_shape) if custom else eval_batches(cfg)
    result = compare(model, session, batches)
    verify_seconds = time.perf_counter() - t0

    acc_torch = None if custom else result.correct_torch / result.n
    acc_ort = None if custom else result.correct_ort / result.n
    report = {
        "format": fmt,
        "model_file": out.name,
        "run_dir": str(run_dir),
        "model": cfg.model if name == cfg.model else f"{cfg.model} ({name})",
        "checkpoint_epoch": epoch,
        "exporter": exporter,
        "opset": OPSET,
        "input_name": INPUT_NAME,
        "output_name": OUTPUT_NAME,
        "input_shape": list(input_shape),
        "dynamic_batch": True,
        "dtype": "float32",
        "verified_on": "random inputs" if custom else f"{cfg.data} test set",
        "execution_provider": "CPUExecutionProvider",
        "n_images": result.n,
        "max_abs_logit_diff": result.max_abs_diff,
        "tolerance": TOLERANCE,
        "argmax_disagreements": result.argmax_disagreements,
        "acc_torch": acc_torch,
        "acc_onnxruntime": acc_ort,
        "equal_accuracy": None if custom else result.correct_torch == result.correct_ort,
        "torch": torch.__version__,
        **versions,
        "export_seconds": round(export_seconds, 3),
        "verify_seconds": round(verify_seconds, 3),
    }
    if custom:
        say(f"verified on {result.n} random {shape_text} inputs (this run trained on custom data; no test set "
            f"to load), onnxruntime {versions['onnxruntime']} CPUExecutionProvider: max |logit diff| "
            f"{result.max_abs_diff:.3g} (tolerance {TOLERANCE:g})")
    else:
        say(f"verified on the {result.n:,} {cfg.data} test images, onnxruntime {versions['onnxruntime']} "
            f"CPUExecutionProvider: max |logit diff| {result.max_abs_diff:.3g} (tolerance {TOLERANCE:g}), "
            f"test acc torch {acc_torch:.4f}, onnxruntime {acc_ort:.4f}"
            f"{' (equal)' if report['equal_accuracy'] else ' (DIFFERENT)'}, {verify_seconds:.1f} s")

    problems = []
    if not result.max_abs_diff <= TOLERANCE:  # also catches NaN
        problems.append(f"max |logit diff| {result.max_abs_diff:.3g} > {TOLERANCE:g}")
    if report["equal_accuracy"] is False:
        problems.append(f"test acc torch {acc_torch:.4f} != onnxruntime {acc_ort:.4f}")
    if problems:
        raise VerificationFailed(f"verification failed: {'; '.join(problems)}; nothing written")

    json_path = report_path(out)
    try:
        # Together: no model without its numbers, and a failure leaves the old pair as it was.
        outputs.write({out.name: model_bytes, json_path.name: json_bytes(report)}, together=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write ({e.strerror or e}); choose another --out") from None
    say(f"wrote {out} ({len(model_bytes) / 1e6:.1f} MB) and {json_path} in {time.perf_counter() - t_start:.1f} s")
    return report
