"""`--out` of every command writing results (profile, profile --try, bench, plan, export) never
replaces a file gpulab did not write there: each test plants the user's file, which must survive
byte for byte while the command refuses in one line, before its work; then --force replaces it,
and a second run into the folder gpulab made goes through. A run's profile/ folder that is a
link is refused, not written through. A failed write leaves the old outputs in place."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from gpulab import export as export_module
from gpulab.cli import main
from gpulab.io import OUTPUTS_RECORD
from tests.conftest import assert_one_line_error, disk_full_for, make_idx_dataset, run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

USER_BYTES = b"the user's own file\n\x00\xff"


def plant(folder: Path, *names: str) -> dict[Path, bytes]:
    """The user's files, each with its own content: what must survive a refused command."""
    folder.mkdir(parents=True, exist_ok=True)
    planted = {}
    for name in names:
        (folder / name).write_bytes(USER_BYTES + name.encode())
        planted[folder / name] = USER_BYTES + name.encode()
    return planted


def assert_untouched(planted: dict[Path, bytes]) -> None:
    for path, content in planted.items():
        assert not path.is_symlink() and path.read_bytes() == content, f"{path} was changed"


def refusal(folder: Path, name: str) -> str:
    return f"--out {folder} holds {name}, which gpulab did not write: choose a new or empty folder, or pass --force"


# ----------------------------------------------------------------------------- gpulab profile


@pytest.fixture
def script(tmp_path) -> tuple[Path, Path]:
    """A 3-line script that imports nothing heavy and leaves a mark when it runs: (script, mark)."""
    path, mark = tmp_path / "job.py", tmp_path / "ran"
    path.write_text(f"import pathlib\npathlib.Path({str(mark)!r}).touch()\nprint('done')\n")
    return path, mark


def test_profile_refuses_to_replace_the_users_report_and_trace_before_running_the_job(tmp_path, script, capsys):
    job, ran = script
    out = tmp_path / "prof"
    planted = plant(out, "report.json", "trace.json")
    code, _, err = run_cli(["profile", "--out", str(out), "--", sys.executable, str(job)], capsys)
    assert_one_line_error(code, err, refusal(out, "report.json"))
    assert_untouched(planted)
    assert not ran.exists() and sorted(p.name for p in out.iterdir()) == ["report.json", "trace.json"]

    code, _, err = run_cli(["profile", "--out", str(out), "--force", "--", sys.executable, str(job)], capsys)
    assert code == 0, err
    assert ran.exists() and "steps" in json.loads((out / "report.json").read_text())
    assert (out / "trace.json").read_bytes() != planted[out / "trace.json"]

    ran.unlink()
    code, _, err = run_cli(["profile", "--out", str(out), "--", sys.executable, str(job)], capsys)
    assert code == 0, err  # the folder gpulab made: its own files are replaced without --force
    assert ran.exists()


def test_profile_try_refuses_to_replace_the_users_try_json_before_any_run(tmp_path, script, capsys, monkeypatch):
    from gpulab.monitor.parent import trial

    job, ran = script
    out = tmp_path / "trial"
    planted = plant(out, "try.json")
    argv = ["profile", "--out", str(out), "--try", "num_workers=0", "--steps", "3", "--", sys.executable, str(job)]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, refusal(out, "try.json"))
    assert_untouched(planted)
    assert not ran.exists()

    # With --force the result is written over it: the trial's runs (seconds each) are not what is tested here.
    measured = {"steps": 3, "warmup_steps": 5, "runs": {}, "pairs": [1.0, 1.0], "reliable": True, "speedup": 1.0,
                "verdict": "within the spread of the steps: no clear change"}
    monkeypatch.setattr(trial._Trial, "run_until_stable", lambda self, change, label, max_pairs: None)
    monkeypatch.setattr(trial._Trial, "result", lambda self, change, label: measured)
    code, _, err = run_cli([*argv[:3], "--force", *argv[3:]], capsys)
    assert code == 0, err
    assert json.loads((out / "try.json").read_text()) == measured
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err


@pytest.mark.parametrize("where", ["dangling link", "loop", "/dev/null", "/proc/gpulab-x"])
def test_profile_out_that_cannot_be_a_folder_is_one_line(where, tmp_path, script, capsys):
    job, ran = script
    out = tmp_path / "out"
    if where == "dangling link":
        out.symlink_to(tmp_path / "nowhere")
    elif where == "loop":
        out.symlink_to(tmp_path / "other")
        (tmp_path / "other").symlink_to(out)
    else:
        out = Path(where)
    code, _, err = run_cli(["profile", "--out", str(out), "--", sys.executable, str(job)], capsys)
    assert_one_line_error(code, err, str(out))
    assert not ran.exists() and not (tmp_path / "nowhere").exists()


def test_a_run_whose_profile_folder_is_a_link_is_refused_not_written_through(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPULAB_DATA", str(make_idx_dataset(tmp_path / "fashion", num_train=256, num_test=64)))
    run = tmp_path / "run"
    code, _, err = run_cli(["train", "--devices", "cpu", "--epochs", "1", "--batch-size", "64", "--profile",
                            "--out", str(run)], capsys)
    assert code == 0, err
    code, _, err = run_cli(["train", "--resume", str(run), "--epochs", "2"], capsys)
    assert code == 0, err  # profiled again into the profile/ folder it made
    assert "steps" in json.loads((run / "profile" / "report.json").read_text())

    elsewhere = tmp_path / "elsewhere"
    planted = plant(elsewhere, "report.json", "timeline.png")
    (run / "profile").rename(tmp_path / "old-profile")
    (run / "profile").symlink_to(elsewhere)
    code, _, err = run_cli(["train", "--resume", str(run), "--epochs", "3"], capsys)
    assert_one_line_error(code, err, f"{run / 'profile'} is a link", "remove the link")
    assert_untouched(planted)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["report.json", "timeline.png"]


# ----------------------------------------------------------------------------- gpulab bench


def test_bench_refuses_to_replace_the_users_vectorize_json_before_benchmarking(tmp_path, capsys):
    out = tmp_path / "bench"
    planted = plant(out, "vectorize.json")
    argv = ["bench", "vectorize", "--preset", "tiny", "--devices", "cpu", "--out", str(out)]
    code, stdout, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, refusal(out, "vectorize.json"))
    assert_untouched(planted)
    assert "vectorize" not in stdout and not (out / "vectorize.png").exists()  # nothing measured

    code, _, err = run_cli([*argv, "--force"], capsys)
    assert code == 0, err
    assert json.loads((out / "vectorize.json").read_text())["benchmark"] == "vectorize"
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err  # its own files, replaced, written atomically: no temporary left behind
    assert sorted(p.name for p in out.iterdir()) == [".gpulab-outputs.json", "vectorize.json", "vectorize.png"]

    # A file of gpulab's that the user changed is theirs now.
    edited = {out / "vectorize.png": b"edited by hand"}
    (out / "vectorize.png").write_bytes(edited[out / "vectorize.png"])
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, refusal(out, "vectorize.png"))
    assert_untouched(edited)


def test_bench_replaces_a_link_itself_and_only_with_force(tmp_path, capsys):
    out = tmp_path / "bench"
    out.mkdir()
    target = plant(tmp_path / "mine", "results.json")
    (out / "vectorize.json").symlink_to(next(iter(target)))
    argv = ["bench", "vectorize", "--preset", "tiny", "--devices", "cpu", "--out", str(out)]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, f"--out {out} holds vectorize.json, a link gpulab did not make", "--force")
    code, _, err = run_cli([*argv, "--force"], capsys)
    assert code == 0, err
    assert not (out / "vectorize.json").is_symlink()  # the link replaced, what it pointed to untouched
    assert_untouched(target)


# ----------------------------------------------------------------------------- gpulab plan


@pytest.fixture
def measured_step(monkeypatch):
    """plan's step measurement (a subprocess, seconds) replaced by a fixed profile: what the
    outputs are written from is not what is tested here."""
    from gpulab.plan import step
    from gpulab.plan.profile import StepProfile

    def measure(train, batch, threads, seconds, copies):
        memory = {"peak": 1000 + 10 * batch, "batch": batch, "largest_unit": 30,
                  "at_peak": {"optimizer_state": 200, "other_kept": 50},
                  "sizes": {"parameters": 100, "gradients": 100, "optimizer_state": 200, "activations": 10 * batch,
                            "inputs": batch}}
        return StepProfile(batch=batch, step_s=0.01, before_backward_s=0.0, backward_s=0.0, after_backward_s=0.0,
                           bucket_bytes=[1000], bucket_ready_s=[0.0], device="cpu", threads=threads, copies=copies,
                           step_times_s=[0.01], memory=memory)

    monkeypatch.setattr(step, "measure", measure)


def test_plan_refuses_to_replace_the_users_plan_json_before_measuring(tmp_path, tiny_data, measured_step, capsys):
    out = tmp_path / "plan"
    planted = plant(out, "plan.json")
    argv = ["plan", "--devices", "cpu", "--batch-size", "32", "--no-sweep", "--devices-per-node", "1", "--out", str(out)]
    code, stdout, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, refusal(out, "plan.json"))
    assert_untouched(planted)
    assert "Assumptions" not in stdout and not (out / "plan.png").exists()

    code, _, err = run_cli([*argv, "--force"], capsys)
    assert code == 0, err
    assert json.loads((out / "plan.json").read_text())["rows"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err


# ----------------------------------------------------------------------------- gpulab export


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One short epoch of LeNet on a small synthetic dataset (also $GPULAB_DATA for the module)."""
    from gpulab.train import TrainConfig, train
    from tests.conftest import one_thread

    data = make_idx_dataset(tmp_path_factory.mktemp("fashion"), num_train=256, num_test=64)
    run_dir = tmp_path_factory.mktemp("runs") / "lenet"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPULAB_DATA", str(data))
        with one_thread():
            train(TrainConfig(devices="cpu", epochs=1, batch_size=64, out=str(run_dir)))
        yield run_dir


@pytest.fixture
def quick_export(monkeypatch):
    """The exporter and onnxruntime's check (seconds, tested in tests/test_export.py) replaced by a
    passing stand-in: what is tested here is what is written, and over what."""
    pytest.importorskip("onnxruntime", reason="needs the onnx extra: pip install 'gpulab[onnx]'")
    pytest.importorskip("onnxscript", reason="needs the onnx extra: pip install 'gpulab[onnx]'")
    exports = iter(range(1, 1000))
    monkeypatch.setattr(export_module, "export_onnx", lambda model, shape: (f"model {next(exports)}".encode(), "stand-in"))
    monkeypatch.setattr(export_module, "ort_session", lambda model_bytes: None)
    monkeypatch.setattr(export_module, "compare", lambda model, session, batches: export_module.Comparison(
        n=64, correct_torch=10, correct_ort=10))


def test_export_leaves_the_old_model_when_its_numbers_cannot_be_written(trained_run, quick_export, tmp_path, capsys):
    out = tmp_path / "prev.onnx"
    code, _, err = run_cli(["export", str(trained_run), "--out", str(out)], capsys)
    assert code == 0, err
    previous = {out: out.read_bytes(), tmp_path / "prev.onnx.json": (tmp_path / "prev.onnx.json").read_bytes()}

    # prev.onnx.json a folder: refused before the export, even with --force; the old model stays.
    (tmp_path / "prev.onnx.json").unlink()
    (tmp_path / "prev.onnx.json").mkdir()
    for force in ([], ["--force"]):
        code, stdout, err = run_cli(["export", str(trained_run), "--out", str(out), *force], capsys)
        assert_one_line_error(code, err, f"--out {out}: its folder holds prev.onnx.json, a folder")
        assert "exported" not in stdout
        assert out.read_bytes() == previous[out]
    (tmp_path / "prev.onnx.json").rmdir()
    (tmp_path / "prev.onnx.json").write_bytes(previous[tmp_path / "prev.onnx.json"])

    # A full disk while writing the numbers: neither file replaced.
    with pytest.MonkeyPatch.context() as mp:
        disk_full_for(mp, "prev.onnx.json")
        code, _, err = run_cli(["export", str(trained_run), "--out", str(out)], capsys)
    assert_one_line_error(code, err, "cannot write", "No space left on device")
    assert_untouched(previous)
    assert not list(tmp_path.glob(".*.tmp"))

    code, _, err = run_cli(["export", str(trained_run), "--out", str(out)], capsys)
    assert code == 0, err  # its own pair: replaced together
    assert out.read_bytes() != previous[out]


def test_export_refuses_to_replace_the_users_model_file(trained_run, quick_export, tmp_path, capsys):
    planted = plant(tmp_path, "model.onnx")
    out = tmp_path / "model.onnx"
    code, stdout, err = run_cli(["export", str(trained_run), "--out", str(out)], capsys)
    assert_one_line_error(code, err, f"--out {out}: its folder holds model.onnx, which gpulab did not write",
                          "choose another --out, or pass --force")
    assert_untouched(planted)
    assert "exported" not in stdout and not (tmp_path / "model.onnx.json").exists()
    code, _, err = run_cli(["export", str(trained_run), "--out", str(out), "--force"], capsys)
    assert code == 0, err
    assert out.read_bytes() == b"model 1" and json.loads((tmp_path / "model.onnx.json").read_text())["n_images"] == 64


# ----------------------------------------------------------------------------- --out ""


@pytest.mark.parametrize("argv", [
    ["profile", "--out", "", "--", sys.executable, "job.py"],
    ["bench", "vectorize", "--preset", "tiny", "--out", ""],
    ["plan", "--devices", "cpu", "--out", ""],
    ["export", "RUN", "--out", ""],
], ids=["profile", "bench", "plan", "export"])
def test_an_empty_out_is_one_line_not_the_default(argv, tmp_path, capsys, monkeypatch, measured_step):
    if argv[0] == "export":
        pytest.importorskip("onnxruntime", reason="needs the onnx extra: pip install 'gpulab[onnx]'")
        pytest.importorskip("onnxscript", reason="needs the onnx extra: pip install 'gpulab[onnx]'")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text("print('ran')\n")
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "--out '': an empty path; give a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py"]  # no default folder made, no record written
    assert not (tmp_path / OUTPUTS_RECORD).exists()


def test_a_forged_record_cannot_make_a_start_over_remove_files_outside_the_profile_folder(tiny_data, tmp_path):
    """A run folder from elsewhere: its profile/ record names a file outside it (../../keep.txt),
    with that file's own hash. Starting the run over in place removes the folder's own files only."""
    run = tmp_path / "run"
    argv = ["train", "--epochs", "1", "--batch-size", "256", "--devices", "cpu", "--out", str(run)]
    assert main([*argv, "--profile"]) == 0
    (run / "checkpoint.pt").unlink()  # as if stopped before its first checkpoint
    outside = tmp_path / "keep.txt"
    outside.write_text("not the run's")
    forged = {"../../keep.txt": [hashlib.sha256(outside.read_bytes()).hexdigest()]}
    record = run / "profile" / OUTPUTS_RECORD
    record.write_text(json.dumps({**json.loads(record.read_text()), "files": forged}))
    assert main(argv) == 0
    assert outside.read_text() == "not the run's"
