"""`gpulab export`: a tiny trained run exported to ONNX and checked with onnxruntime; one-line
errors for bad input; nothing written when the check fails."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import assert_one_line_error, disk_full_for, run_cli as run
from gpulab import export as export_module
from gpulab.cli import main
from gpulab.errors import UserError
from gpulab.train import TrainConfig, train
from gpulab.train.rundir import CHECKPOINT

if os.environ.get("CI"):  # `make test` installs the extra: in CI a missing package is a failure, not a skip
    import onnx
    import onnxruntime as ort
    import onnxscript  # noqa: F401
else:
    onnx = pytest.importorskip("onnx", reason="needs the onnx extra: pip install 'gpulab[onnx]'")
    ort = pytest.importorskip("onnxruntime", reason="needs the onnx extra: pip install 'gpulab[onnx]'")
    pytest.importorskip("onnxscript", reason="needs the onnx extra: pip install 'gpulab[onnx]'")

RUN_FILES = ["checkpoint.pt", "config.json", "curves.png", "metrics.csv", "metrics.json"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Three short epochs of LeNet on the small synthetic IDX dataset (also $GPULAB_DATA for the
    module: export verifies on that run's test set, 256 images)."""
    # pytest registers tests/conftest.py as `tests.conftest`; its fixtures are per test.
    from tests.conftest import make_idx_dataset, one_thread

    data = make_idx_dataset(tmp_path_factory.mktemp("fashion"))
    run_dir = tmp_path_factory.mktemp("runs") / "lenet"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPULAB_DATA", str(data))
        with one_thread():
            train(TrainConfig(devices="cpu", epochs=3, batch_size=32, out=str(run_dir)))
        yield run_dir, data






@pytest.fixture(scope="module")
def exported(tiny_run):
    """`gpulab export RUN_DIR` once for the module: (exit code, stdout, stderr)."""
    run_dir, _ = tiny_run
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["export", str(run_dir)])
    return code, out.getvalue(), err.getvalue()


def reference_model(run_dir: Path) -> torch.nn.Module:
    """The run's LeNet, rebuilt here without gpulab.export's code."""
    from gpulab.models import LeNet

    model = LeNet()
    state = torch.load(run_dir / CHECKPOINT, map_location="cpu", weights_only=False)["strategy"]["model"]
    model.load_state_dict(state)
    return model.eval()


def reference_test_set(data: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The test split, normalised as the modern recipe does (training-set mean/std), by hand."""
    from gpulab.data import load

    _, test = load(data)
    X = (test.images.float() / 255.0 - 0.2860) / 0.3530
    return X, test.labels


# ----------------------------------------------------------------------------- the export


def test_export_writes_a_verified_model_and_its_numbers(tiny_run, exported):
    run_dir, data = tiny_run
    code, stdout, stderr = exported
    assert code == 0, stderr
    assert stderr == ""
    names = {p.name for p in run_dir.iterdir()}
    assert {"model.onnx", "model.onnx.json", *RUN_FILES} <= names
    assert not [n for n in names if n.endswith(".tmp")]  # no temporary file left behind
    report = json.loads((run_dir / "model.onnx.json").read_text())
    assert report["opset"] == export_module.OPSET == 18
    assert report["input_shape"] == [1, 28, 28] and report["dynamic_batch"] is True
    assert report["verified_on"] == "fashion-mnist test set"
    assert report["n_images"] == 256
    assert 0 <= report["max_abs_logit_diff"] <= 1e-4
    assert report["equal_accuracy"] is True and report["acc_torch"] == report["acc_onnxruntime"]
    assert report["argmax_disagreements"] == 0
    assert report["exporter"] == "torch.export (dynamo=True)"
    assert report["torch"] == torch.__version__
    assert report["onnx"] == onnx.__version__ and report["onnxruntime"] == ort.__version__
    # The accuracy is the real one, on the test set normalised as in training: recomputed here by hand.
    X, y = reference_test_set(data)
    with torch.no_grad():
        expected = (reference_model(run_dir)(X).argmax(1) == y).float().mean().item()
    assert report["acc_torch"] == pytest.approx(expected, abs=1e-9)
    assert report["acc_torch"] > 0.5  # the model learned: a wrong normalisation would show here
    # The terminal says the same numbers, and the opset.
    assert "opset 18" in stdout and "dynamic batch" in stdout
    assert f"max |logit diff| {report['max_abs_logit_diff']:.3g}" in stdout
    assert f"test acc torch {report['acc_torch']:.4f}, onnxruntime {report['acc_onnxruntime']:.4f} (equal)" in stdout


def test_verification_uses_the_trainers_test_batches(tiny_run):
    """The images checked are the run's whole test set, normalised as in training."""
    from gpulab.train.rundir import RunDir

    run_dir, data = tiny_run
    cfg = TrainConfig.from_dict(RunDir(run_dir).read_config())
    batches = list(export_module.eval_batches(cfg))
    X = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    X_ref, y_ref = reference_test_set(data)
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(X, X_ref, atol=1e-5, rtol=0)


def test_model_has_a_dynamic_batch(tiny_run, exported):
    run_dir, data = tiny_run
    assert exported[0] == 0
    model_file = run_dir / "model.onnx"
    graph = onnx.load(str(model_file)).graph
    assert [i.name for i in graph.input] == ["images"] and [o.name for o in graph.output] == ["logits"]
    dims = graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and not dims[0].HasField("dim_value")
    assert [d.dim_value for d in dims[1:]] == [1, 28, 28]
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    X, _ = reference_test_set(data)
    model = reference_model(run_dir)
    for n in (1, 7):
        logits = session.run(None, {"images": X[:n].numpy()})[0]
        assert logits.shape == (n, 10)
        with torch.no_grad():
            np.testing.assert_allclose(logits, model(X[:n]).numpy(), atol=1e-4, rtol=0)


def test_custom_data_run_is_verified_on_random_inputs(tmp_path, capsys):
    """A run on the caller's own data has no test set in its directory: random inputs, logits only."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(64, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (64,), generator=generator)
    dataset = torch.utils.data.TensorDataset(images, labels)
    run_dir = tmp_path / "custom"
    train(TrainConfig(devices="cpu", epochs=1, batch_size=32, out=str(run_dir)), train_data=dataset, test_data=dataset)
    out = tmp_path / "custom.onnx"
    code, stdout, err = run(["export", str(run_dir), "--out", str(out)], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "custom.onnx.json").read_text())
    assert report["verified_on"] == "random inputs" and report["n_images"] == export_module.RANDOM_INPUTS == 256
    assert report["max_abs_logit_diff"] <= 1e-4
    assert report["acc_torch"] is None and report["acc_onnxruntime"] is None and report["equal_accuracy"] is None
    assert "256 random 1x28x28 inputs" in stdout and "no test set" in stdout
    assert out.is_file() and not (run_dir / "model.onnx").exists()


def test_model_passed_as_an_object(tmp_path, capsys):
    """Such a run cannot be rebuilt from its directory: the CLI says so in one line; from Python a
    fresh instance takes the checkpoint's weights, and its own input shape ([20]) is exported."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(128, 20, generator=generator)
    dataset = torch.utils.data.TensorDataset(X, (X[:, 0] > 0).long())

    def mlp():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    run_dir = tmp_path / "own"
    train(TrainConfig(devices="cpu", epochs=1, batch_size=32, out=str(run_dir)), train_data=dataset,
          test_data=dataset, model=mlp())
    code, _, err = run(["export", str(run_dir)], capsys)
    assert_one_line_error(code, err, "passed to train() as an object", "gpulab.export.export(run_dir, model=")
    assert not (run_dir / "model.onnx").exists()

    report = export_module.export(run_dir, model=mlp(), say=lambda line: None)
    assert report["input_shape"] == [20] and report["verified_on"] == "random inputs"
    assert report["max_abs_logit_diff"] <= 1e-4
    session = ort.InferenceSession(str(run_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    trained = mlp()
    trained.load_state_dict(torch.load(run_dir / CHECKPOINT, weights_only=False)["strategy"]["model"])
    with torch.no_grad():
        np.testing.assert_allclose(session.run(None, {"images": X[:3].numpy()})[0], trained(X[:3]).numpy(), atol=1e-5)


def test_torchscript_exporter_when_torch_export_fails(tiny_run, tmp_path, capsys, monkeypatch):
    """A model torch.export cannot trace goes through the TorchScript exporter (said in the JSON);
    when both fail, one line names both reasons."""
    run_dir, _ = tiny_run

    def cannot_trace(model, example):
        raise RuntimeError("data-dependent control flow\n(long explanation)")

    monkeypatch.setitem(export_module.EXPORTERS, "torch.export (dynamo=True)", cannot_trace)
    out = tmp_path / "ts.onnx"
    code, stdout, err = run(["export", str(run_dir), "--out", str(out)], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "ts.onnx.json").read_text())
    assert report["exporter"] == "torchscript (dynamo=False)" and report["opset"] == 18
    assert report["equal_accuracy"] is True and report["max_abs_logit_diff"] <= 1e-4
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.run(None, {"images": np.zeros((7, 1, 28, 28), np.float32)})[0].shape == (7, 10)

    monkeypatch.setitem(export_module.EXPORTERS, "torchscript (dynamo=False)", cannot_trace)
    out.unlink()
    code, _, err = run(["export", str(run_dir), "--out", str(out)], capsys)
    assert_one_line_error(code, err, "could not export", "torch.export (dynamo=True): data-dependent control flow",
                          "torchscript (dynamo=False): data-dependent control flow")
    assert not out.exists()


# ----------------------------------------------------------------------------- failures write nothing


class SkewedSession:
    """onnxruntime's session, with its logits changed as a faulty export would change them."""

    def __init__(self, session, shift: float):
        self.session, self.shift = session, shift

    def run(self, names, feeds):
        logits = self.session.run(names, feeds)[0]
        logits[:, 0] += self.shift  # class 0 wins more often: the accuracy changes too
        return [logits]


@pytest.fixture
def reuse_export(tiny_run, exported, monkeypatch):
    """Skip the exporter (seconds on two cores): hand back the module's verified model.onnx."""
    model_bytes = (tiny_run[0] / "model.onnx").read_bytes()
    monkeypatch.setattr(export_module, "export_onnx", lambda model, shape: (model_bytes, "torch.export (dynamo=True)"))


def test_failed_verification_writes_nothing(tiny_run, reuse_export, tmp_path, capsys, monkeypatch):
    run_dir, _ = tiny_run
    real = export_module.ort_session
    monkeypatch.setattr(export_module, "ort_session", lambda model_bytes: SkewedSession(real(model_bytes), 50.0))
    folder = tmp_path / "out"
    folder.mkdir()
    code, stdout, err = run(["export", str(run_dir), "--out", str(folder / "model.onnx")], capsys)
    assert_one_line_error(code, err, "verification failed", "max |logit diff| 50 > 0.001", "test acc torch",
                          "nothing written", exit_code=1)
    assert "(DIFFERENT)" in stdout
    assert list(folder.iterdir()) == []  # no model, no JSON, no temporary file


@pytest.mark.parametrize("shift, passes", [(5e-4, True), (2e-3, False)])
def test_tolerance_is_1e_3(tiny_run, reuse_export, tmp_path, capsys, monkeypatch, shift, passes):
    """A 5e-4 logit shift passes, a 2e-3 one fails (the argmax is unchanged by both here)."""
    run_dir, _ = tiny_run
    real = export_module.ort_session
    monkeypatch.setattr(export_module, "ort_session", lambda model_bytes: SkewedSession(real(model_bytes), shift))
    out = tmp_path / "model.onnx"
    code, stdout, err = run(["export", str(run_dir), "--out", str(out)], capsys)
    assert "(equal)" in stdout
    if passes:
        assert code == 0, err
        assert json.loads((tmp_path / "model.onnx.json").read_text())["max_abs_logit_diff"] == pytest.approx(shift, rel=0.01)
    else:
        assert_one_line_error(code, err, "max |logit diff| 0.002 > 0.001", exit_code=1)
    assert out.exists() == passes


def test_failed_json_write_leaves_no_model(tiny_run, reuse_export, tmp_path, capsys, monkeypatch):
    run_dir, _ = tiny_run
    disk_full_for(monkeypatch, "model.onnx.json")
    folder = tmp_path / "out"
    folder.mkdir()
    code, _, err = run(["export", str(run_dir), "--out", str(folder / "model.onnx")], capsys)
    assert_one_line_error(code, err, "cannot write", "No space left on device")
    assert list(folder.iterdir()) == []


def test_missing_extra_is_one_line(tiny_run, tmp_path, capsys, monkeypatch):
    run_dir, _ = tiny_run
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    out = tmp_path / "model.onnx"
    code, _, err = run(["export", str(run_dir), "--out", str(out)], capsys)
    assert_one_line_error(code, err, "onnxruntime", "pip install 'gpulab[onnx]'")
    assert not out.exists()


# ----------------------------------------------------------------------------- bad input


def copy_of_run(tiny_run, tmp_path: Path, without: tuple[str, ...] = ()) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run[0], run_dir, ignore=shutil.ignore_patterns("model.onnx*"))
    for name in without:
        (run_dir / name).unlink()
    return run_dir


def test_run_dir_missing(tmp_path, capsys):
    code, _, err = run(["export", str(tmp_path / "nope")], capsys)
    assert_one_line_error(code, err, f"{tmp_path / 'nope'} does not exist", "gpulab train run")
    assert not (tmp_path / "nope").exists()


def test_run_dir_is_a_file(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = run(["export", str(a_file)], capsys)
    assert_one_line_error(code, err, "is not a directory")


def test_run_dir_is_not_a_run(tmp_path, capsys):
    code, _, err = run(["export", str(tmp_path)], capsys)
    assert_one_line_error(code, err, "is not a gpulab run directory (no config.json)")
    assert list(tmp_path.iterdir()) == []


def test_run_without_checkpoint(tiny_run, tmp_path, capsys):
    run_dir = copy_of_run(tiny_run, tmp_path, without=(CHECKPOINT,))
    code, _, err = run(["export", str(run_dir)], capsys)
    assert_one_line_error(code, err, f"{run_dir}: no checkpoint.pt", "before its first epoch ended")
    assert not (run_dir / "model.onnx").exists()


def test_damaged_checkpoint(tiny_run, tmp_path, capsys):
    run_dir = copy_of_run(tiny_run, tmp_path)
    (run_dir / CHECKPOINT).write_bytes(b"not a checkpoint")
    code, _, err = run(["export", str(run_dir)], capsys)
    assert_one_line_error(code, err, f"{run_dir}: checkpoint.pt is unreadable")
    assert "--resume" not in err
    assert not (run_dir / "model.onnx").exists()


@pytest.mark.parametrize("plant, said", [
    ("wrong shape", "size mismatch for fc2.weight"),
    ("nan", "the checkpoint's fc2.weight holds NaN or infinite values"),
    ("folder", "its checkpoint.pt is a directory, not a file"),
])
def test_a_checkpoint_that_cannot_be_exported_says_why(tiny_run, tmp_path, capsys, plant, said):
    """Weights of the wrong shape said only torch's header line; NaN weights were called a failed
    verification of the export; a folder named checkpoint.pt, no checkpoint at all."""
    run_dir = copy_of_run(tiny_run, tmp_path)
    if plant == "folder":
        (run_dir / CHECKPOINT).unlink()
        (run_dir / CHECKPOINT).mkdir()
    else:
        checkpoint = torch.load(run_dir / CHECKPOINT, weights_only=True)
        weights = checkpoint["strategy"]["model"]
        weights["fc2.weight"] = torch.zeros(3, 3) if plant == "wrong shape" else torch.full_like(weights["fc2.weight"], float("nan"))
        torch.save(checkpoint, run_dir / CHECKPOINT)
    code, _, err = run(["export", str(run_dir)], capsys)
    assert_one_line_error(code, err, said)
    assert not (run_dir / "model.onnx").exists()


def test_out_is_an_existing_directory(tiny_run, tmp_path, capsys):
    code, _, err = run(["export", str(tiny_run[0]), "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, err, f"--out {tmp_path} is a directory", "give a file name")


@pytest.mark.parametrize("name, taken", [("checkpoint.pt", "checkpoint.pt"), ("metrics", "metrics.json")])
def test_out_over_a_file_of_the_run_is_refused_even_with_force(tiny_run, capsys, name, taken):
    """The run wrote checkpoint.pt, not an export: --force would have put ONNX in its place."""
    run_dir = tiny_run[0]
    before = (run_dir / taken).read_bytes()
    code, _, err = run(["export", str(run_dir), "--out", str(run_dir / name), "--force"], capsys)
    assert_one_line_error(code, err, f"{run_dir / taken} is a file of the run in {run_dir}, never replaced by an export")
    assert (run_dir / taken).read_bytes() == before


@pytest.mark.parametrize("name", [".gpulab-outputs.json", ".gpulab-outputs"])
def test_out_named_like_gpulab_s_record_is_refused(tiny_run, tmp_path, capsys, name):
    """The model (or its report) went where gpulab's record of its writes goes, and the record over
    it: 'wrote ...', exit 0, and no model (a helper's finding)."""
    folder = tmp_path / "exports"
    folder.mkdir()
    code, _, err = run(["export", str(tiny_run[0]), "--out", str(folder / name)], capsys)
    assert_one_line_error(code, err, ".gpulab-outputs.json is the name of gpulab's record of what it wrote there")
    assert list(folder.iterdir()) == []


def test_out_in_a_missing_folder(tiny_run, tmp_path, capsys):
    out = tmp_path / "nope" / "model.onnx"
    code, _, err = run(["export", str(tiny_run[0]), "--out", str(out)], capsys)
    assert_one_line_error(code, err, f"folder {tmp_path / 'nope'} does not exist")
    assert not (tmp_path / "nope").exists()


def test_out_under_a_file(tiny_run, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = run(["export", str(tiny_run[0]), "--out", str(a_file / "model.onnx")], capsys)
    assert_one_line_error(code, err, "is a file, not a folder")
    assert a_file.read_text() == "x"


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="no sysfs")
def test_out_where_even_root_cannot_create_a_file_is_refused_before_the_export(tiny_run, capsys, monkeypatch):
    """os.access says yes to root in /sys; creating a file there fails all the same."""
    def no_export(*args, **kwargs):
        raise AssertionError("the export ran before --out was checked")
    monkeypatch.setattr(export_module, "export_onnx", no_export)
    code, _, err = run(["export", str(tiny_run[0]), "--out", "/sys/kernel/model.onnx"], capsys)
    assert_one_line_error(code, err, "/sys/kernel is not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders anyway")
def test_out_in_a_read_only_folder(tiny_run, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = run(["export", str(tiny_run[0]), "--out", str(locked / "model.onnx")], capsys)
        assert_one_line_error(code, err, "is not writable")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_unknown_format(tiny_run, tmp_path, capsys):
    code, _, err = run(["export", str(tiny_run[0]), "--format", "tflite", "--out", str(tmp_path / "m")], capsys)
    assert_one_line_error(code, err, "--format", "invalid choice: 'tflite'", "onnx")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match="--format tflite: unknown format; choose onnx"):
        export_module.export(tiny_run[0], tmp_path / "m", fmt="tflite")
