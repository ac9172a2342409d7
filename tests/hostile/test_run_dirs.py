"""A run directory from elsewhere never runs code, never damages what the user did not name, and
fails in one line.

Each test plants one hostile thing in a copy of a real run (made once, 1 epoch of LeNet on a tiny
data set) and checks what must not happen: a marker file that code from the run directory would
create, a file outside the run that must survive byte for byte, a time bound that a hang would
break. Export and --resume are the two commands that read a run directory.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from gpulab.errors import UserError
from gpulab.models import LeNet
from gpulab.parallel import world as world_module
from gpulab.parallel.shard_files import read_shards
from gpulab.parallel.world import TorchrunWorld, from_bytes, to_bytes
from gpulab.train import TrainConfig, train
from gpulab.train.rundir import CHECKPOINT, LOCK
from tests.conftest import assert_one_line_error, make_idx_dataset, one_thread, run_cli, scaled

TRAIN = ["train", "--devices", "cpu", "--epochs", "1", "--batch-size", "32"]


@pytest.fixture(scope="module")
def made_run(tmp_path_factory):
    """A real 1-epoch run (lock, config.json, checkpoint.pt, metrics), and its data."""
    data = make_idx_dataset(tmp_path_factory.mktemp("fashion"), num_train=64, num_test=32)
    run_dir = tmp_path_factory.mktemp("runs") / "made"
    with one_thread():
        train(TrainConfig(devices="cpu", epochs=1, batch_size=32, out=str(run_dir), data_dir=str(data)))
    return run_dir, data


@pytest.fixture
def run_copy(made_run, tmp_path, monkeypatch) -> Path:
    run_dir, data = made_run
    monkeypatch.setenv("GPULAB_DATA", str(data))
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def readers(run_dir: Path, tmp_path: Path) -> list[list[str]]:
    """The two commands that read a run directory."""
    return [["export", str(run_dir), "--out", str(tmp_path / "model.onnx")],
            ["train", "--resume", str(run_dir), "--epochs", "2"]]


class Planted:
    """An object whose unpickling creates `MARKER` (os.system would run anything)."""

    marker = ""

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def planted(marker: Path) -> Planted:
    obj = Planted()
    obj.marker = str(marker)
    return obj


def edit_config(run_dir: Path, **values) -> None:
    path = run_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def gpulab_subprocess(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """gpulab in its own process, so that a hang fails the test after `timeout` instead of holding the suite."""
    return subprocess.run([sys.executable, "-m", "gpulab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


# ----------------------------------------------------------------------------- code runs


@pytest.mark.parametrize("command", ["export", "resume"])
def test_a_checkpoint_that_names_code_is_refused_unrun(run_copy, tmp_path, capsys, command):
    marker = tmp_path / "ran"
    checkpoint = torch.load(run_copy / CHECKPOINT, weights_only=True)
    checkpoint["history"].append(planted(marker))
    torch.save(checkpoint, run_copy / CHECKPOINT)
    before = (run_copy / CHECKPOINT).read_bytes()
    argv = dict(zip(["export", "resume"], readers(run_copy, tmp_path)))[command]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, f"{CHECKPOINT} names posix.mkdir", "is not loaded")
    assert not marker.exists()
    assert (run_copy / CHECKPOINT).read_bytes() == before
    assert not (tmp_path / "model.onnx").exists()


def write_factory(folder: Path, marker: Path) -> str:
    """A module whose factory leaves `marker` when it is called; its spec."""
    (folder / "planted_model.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        from gpulab.models import LeNet

        def build():
            Path({str(marker)!r}).mkdir()
            return LeNet()
    """))
    return "planted_model:build"


@pytest.mark.parametrize("spec", ["os:abort", "pdb:set_trace", "tempfile:mkdtemp", "planted_model:build"])
def test_a_model_named_by_import_path_in_config_json_is_never_imported(run_copy, tmp_path, capsys, spec):
    marker = tmp_path / "ran"
    write_factory(tmp_path, marker)
    edit_config(run_copy, model=spec)
    made = set(os.listdir(tmp_path))
    for argv in readers(run_copy, tmp_path):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, f"names the model {spec}", f"--model {spec}")
    assert set(os.listdir(tmp_path)) == made  # no marker, no mkdtemp, no model.onnx


def test_the_same_import_path_on_the_command_line_is_trusted(run_copy, tmp_path, capsys):
    marker = tmp_path / "ran"
    spec = write_factory(tmp_path, marker)
    edit_config(run_copy, model=spec)
    code, _, err = run_cli(["train", "--resume", str(run_copy), "--epochs", "2", "--model", "other:model"], capsys)
    assert_one_line_error(code, err, f"names the model {spec}")
    assert not marker.exists()
    code, out, err = run_cli(["train", "--resume", str(run_copy), "--epochs", "2", "--model", spec], capsys)
    assert code == 0, err
    assert marker.exists() and "epoch  2/2" in out


def sharded_run(run_dir: Path, model_state: dict, extra: dict | None = None) -> Path:
    """Turn `run_dir` into what --shard fsdp leaves (checkpoint.pt naming a DCP folder), written in
    one process by torch.distributed.checkpoint itself."""
    import torch.distributed.checkpoint as dcp

    folder = run_dir / "checkpoint-epoch1.dcp"
    dcp.save({"model": model_state, **(extra or {})}, checkpoint_id=str(folder), no_dist=True)
    checkpoint = torch.load(run_dir / CHECKPOINT, weights_only=True)
    checkpoint["strategy"] = {"shards": folder.name}
    torch.save(checkpoint, run_dir / CHECKPOINT)
    return folder


def plant_in_metadata(folder: Path, marker: Path) -> None:
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    metadata.planner_data["planted"] = planted(marker)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_sharded_checkpoint_whose_metadata_names_code_is_refused_unless_trusted(run_copy, tmp_path, capsys):
    folder = sharded_run(run_copy, LeNet().state_dict())
    marker = tmp_path / "ran"
    plant_in_metadata(folder, marker)
    out = tmp_path / "model.onnx"
    code, _, err = run_cli(["export", str(run_copy), "--out", str(out)], capsys)
    assert_one_line_error(code, err, "cannot be read safely", "names posix.mkdir", "--trust-checkpoint")
    assert not marker.exists() and not out.exists()
    # Trusted, torch's own reader reads it - and runs what it names: the flag is what decides.
    code, _, err = run_cli(["export", str(run_copy), "--out", str(out), "--trust-checkpoint"], capsys)
    assert code == 0, err
    assert marker.exists()


def test_gpulab_s_own_sharded_checkpoint_reads_as_torch_s_reader_reads_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = LeNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    optimizer.step()
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.save(saved, checkpoint_id=str(tmp_path / "c.dcp"), no_dist=True)

    def empty_state():
        fresh = LeNet()
        opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.1)
        fresh(torch.randn(4, 1, 28, 28)).sum().backward()
        opt.step()
        return {"model": fresh.state_dict(), "optimizer": opt.state_dict()}

    ours, torchs = empty_state(), empty_state()
    read_shards(ours, tmp_path / "c.dcp", no_dist=True)
    dcp.load(torchs, checkpoint_id=str(tmp_path / "c.dcp"), no_dist=True)
    assert ours["optimizer"]["param_groups"][0]["lr"] == 0.1  # a value read from bytes, not a tensor
    for key, value in torchs["model"].items():
        assert torch.equal(ours["model"][key], value)
    for key, state in torchs["optimizer"]["state"].items():
        assert torch.equal(ours["optimizer"]["state"][key]["momentum_buffer"], state["momentum_buffer"])


def test_a_sharded_value_that_names_code_is_refused(tmp_path):
    """Not a tensor (an optimizer's learning rate): torch's planner reads those with weights_only=False."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    dcp.save({"lr": planted(marker)}, checkpoint_id=str(tmp_path / "c.dcp"), no_dist=True)
    with pytest.raises(UserError, match="cannot be read safely .*--trust-checkpoint"):
        read_shards({"lr": 0.1}, tmp_path / "c.dcp", no_dist=True)
    assert not marker.exists()


@pytest.mark.parametrize("where, words", [
    ("/dev/zero", "points at '/dev/zero', not one of the folder's own shard files"),
    ("../elsewhere.distcp", "points at '../elsewhere.distcp'"),
    ("past the end", "points past the end of"),
])
def test_a_sharded_checkpoint_pointing_outside_its_files_is_refused(tmp_path, where, words):
    """DCP's metadata says where each piece lies: a path and a length that are read as they are."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "c.dcp"
    dcp.save({"model": LeNet().state_dict()}, checkpoint_id=str(folder), no_dist=True)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    info = next(iter(metadata.storage_data.values()))
    if where == "past the end":
        info.length = (folder / info.relative_path).stat().st_size + 1
    else:
        info.relative_path = where
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match=re.escape(words)):
        read_shards({"model": LeNet().state_dict()}, folder, no_dist=True)


def test_a_checkpoint_naming_shards_outside_the_run_is_refused(run_copy, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere.dcp"
    sharded_run(run_copy, LeNet().state_dict())
    shutil.move(run_copy / "checkpoint-epoch1.dcp", elsewhere)
    checkpoint = torch.load(run_copy / CHECKPOINT, weights_only=True)
    checkpoint["strategy"] = {"shards": "../elsewhere.dcp"}
    torch.save(checkpoint, run_copy / CHECKPOINT)
    code, _, err = run_cli(["export", str(run_copy), "--out", str(tmp_path / "m.onnx")], capsys)
    assert_one_line_error(code, err, "names the shards '../elsewhere.dcp'", "checkpoint-epoch<N>.dcp")


class PlantedStore:
    """A rendezvous store in which another program wrote a pickle under every key."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def wait(self, keys, timeout):
        pass

    def check(self, keys):
        return True

    def set(self, key, value):
        pass

    def get(self, key):
        return self.payload


def rank_one_of_two(store) -> TorchrunWorld:
    world = TorchrunWorld.__new__(TorchrunWorld)  # its store, without a real rendezvous
    world.rank, world.world_size, world.prefix, world.agreements, world.store = 1, 2, "gpulab/0/1/", 0, store
    return world


def test_rank_messages_are_json_never_unpickled(tmp_path):
    marker = tmp_path / "ran"
    world = rank_one_of_two(PlantedStore(pickle.dumps(planted(marker))))
    for call in (lambda: world.share("config", dict), lambda: world.all_or_none(lambda: None),
                 lambda: world.agree({"--epochs": "1"}, "options")):
        with pytest.raises(UserError, match="malformed message"):
            call()
    assert not marker.exists()
    # ... and what ranks say to each other still arrives.
    store = torch.distributed.HashStore()
    store.set("gpulab/0/1/share/config", json.dumps(["ok", {"epochs": 2}]))
    assert rank_one_of_two(store).share("config", dict) == {"epochs": 2}
    store.set("gpulab/0/1/share/config", json.dumps(["error", "no config"]))
    with pytest.raises(UserError, match="^no config$"):
        rank_one_of_two(store).share("config", dict)


def test_objects_between_ranks_are_data_never_code(tmp_path):
    marker = tmp_path / "ran"
    sent = {"history": [{"epoch": 1, "loss": 0.5}], "w": torch.arange(3.0)}
    received = from_bytes(to_bytes(sent, torch.device("cpu")))
    assert received["history"] == sent["history"] and torch.equal(received["w"], sent["w"])
    crafted = torch.frombuffer(bytearray(pickle.dumps(planted(marker))), dtype=torch.uint8)
    with pytest.raises(pickle.UnpicklingError):
        from_bytes(crafted)
    assert not marker.exists()


def test_no_source_loads_pickled_bytes():
    """Acceptance: no call in gpulab's source unpickles with pickle.load(s) or torch.load's
    weights_only=False (the allow-listed unpickler of shard_files.py is the one Unpickler)."""
    source = Path(world_module.__file__).parent.parent
    found = []
    for path in source.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            unsafe_torch_load = any(k.arg == "weights_only" and not (isinstance(k.value, ast.Constant) and k.value.value)
                                    for k in node.keywords)
            if name in ("pickle.load", "pickle.loads", "pickle.Unpickler") or unsafe_torch_load:
                found.append(f"{path.name}:{node.lineno}: {name}")
            elif name == "torch.load" and not any(k.arg == "weights_only" for k in node.keywords):
                found.append(f"{path.name}:{node.lineno}: torch.load without weights_only=True")
    assert not found


# ----------------------------------------------------------------------------- damage


def link_lock_to(run_dir: Path, target: Path) -> None:
    (run_dir / LOCK).unlink(missing_ok=True)
    (run_dir / LOCK).symlink_to(target)


def test_a_linked_lock_never_writes_its_target(run_copy, made_run, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("DATA\n")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    link_lock_to(fresh, victim)
    code, _, err = run_cli([*TRAIN, "--out", str(fresh)], capsys)
    assert_one_line_error(code, err, f"--out {fresh}")
    link_lock_to(run_copy, victim)
    code, _, err = run_cli(["train", "--resume", str(run_copy)], capsys)
    assert_one_line_error(code, err, f"--resume {run_copy}", f"{LOCK} is not a regular file")
    assert victim.read_text() == "DATA\n"
    # A dangling link: its target is never created.
    link_lock_to(fresh, tmp_path / "created")
    code, _, err = run_cli([*TRAIN, "--out", str(fresh)], capsys)
    assert_one_line_error(code, err, f"--out {fresh}")
    assert not (tmp_path / "created").exists()


def test_a_run_claimed_through_a_linked_lock_is_refused_at_the_lock(tmp_path):
    """The lock itself, opened on a gpulab run's folder: never through a link (the checks before it
    may be raced)."""
    from gpulab.train.rundir import RunDir

    victim = tmp_path / "victim.txt"
    victim.write_text("DATA\n")
    (tmp_path / "run").mkdir()
    link_lock_to(tmp_path / "run", victim)
    with pytest.raises(UserError, match=f"its {LOCK} is a link"):
        RunDir(tmp_path / "run")._take_lock("--out")
    assert victim.read_text() == "DATA\n"


def test_a_hard_linked_lock_never_writes_the_file_it_shares(run_copy, tmp_path, capsys):
    """A hard link is no symbolic link: O_NOFOLLOW lets it through, and the lock's "pid N on host"
    landed in the file outside the run (a helper's finding)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("DATA\n")
    (run_copy / LOCK).unlink()
    os.link(victim, run_copy / LOCK)
    code, _, err = run_cli(["train", "--resume", str(run_copy), "--epochs", "2"], capsys)
    assert_one_line_error(code, err, f"--resume {run_copy}", f"{LOCK} is a link")
    assert victim.read_text() == "DATA\n"


def test_a_folder_that_only_looks_like_a_run_is_not_one(tmp_path, tiny_data, capsys):
    project = tmp_path / "finetune"
    (project / "checkpoint-epoch1.dcp").mkdir(parents=True)
    (project / "checkpoint-epoch1.dcp" / "weights").write_text("weeks of training")
    (project / "config.json").write_text(json.dumps({"model": "bert", "recipe": "lora", "epochs": 3}))
    (project / "metrics.json").write_text("[1, 2, 3]")
    before = {p.relative_to(project): p.read_bytes() for p in project.rglob("*") if p.is_file()}
    code, _, err = run_cli([*TRAIN, "--out", str(project)], capsys)
    assert_one_line_error(code, err, "is not empty and not a gpulab run")
    code, _, err = run_cli(["train", "--resume", str(project)], capsys)
    assert_one_line_error(code, err, f"no {LOCK} there")
    assert {p.relative_to(project): p.read_bytes() for p in project.rglob("*") if p.is_file()} == before


def test_a_folder_in_place_of_a_result_file_is_refused_before_training(run_copy, capsys):
    (run_copy / "curves.png").unlink()
    (run_copy / "curves.png").mkdir()
    code, out, err = run_cli(["train", "--resume", str(run_copy), "--epochs", "2"], capsys)
    assert_one_line_error(code, err, "curves.png is a folder there")
    assert "epoch  2/2" not in out


def test_markup_in_a_run_s_name_is_drawn_as_written(tmp_path, tiny_data, capsys):
    run_dir = tmp_path / "run$\\foo$"
    code, _, err = run_cli([*TRAIN, "--out", str(run_dir)], capsys)
    assert code == 0, err
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_links_in_a_run_are_replaced_or_refused_never_written_through(run_copy, tmp_path, capsys):
    """What held before and must keep holding: a result file that is a link is replaced by the new
    file (its target untouched), a config.json that is a link is not read."""
    victim = tmp_path / "victim.json"
    victim.write_text("DATA\n")
    (run_copy / "metrics.json").unlink()
    (run_copy / "metrics.json").symlink_to(victim)
    code, _, err = run_cli(["train", "--resume", str(run_copy), "--epochs", "2"], capsys)
    assert code == 0, err
    assert not (run_copy / "metrics.json").is_symlink() and victim.read_text() == "DATA\n"
    (run_copy / "config.json").unlink()
    (run_copy / "config.json").symlink_to(victim)
    code, _, err = run_cli(["train", "--resume", str(run_copy), "--epochs", "3"], capsys)
    assert_one_line_error(code, err, "no readable config.json (it is a link)")
    assert victim.read_text() == "DATA\n"


def test_a_linked_shard_folder_is_never_emptied(made_run, tmp_path, tiny_data, capsys):
    """A run started over in place removes its unfinished sharded checkpoints: never through a link."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "weights").write_text("weeks of training")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK).write_text("pid 1 on host\n")  # a gpulab run that stopped before its first checkpoint
    shutil.copy(made_run[0] / "config.json", run_dir / "config.json")
    (run_dir / "checkpoint-epoch1.dcp").symlink_to(victim)
    code, _, err = run_cli([*TRAIN, "--out", str(run_dir)], capsys)
    assert code == 0, err
    assert (victim / "weights").read_text() == "weeks of training"


@pytest.mark.parametrize("where", ["/dev/null", "dangling link", "loop", "empty"])
def test_an_out_that_cannot_be_a_run_is_one_line(tmp_path, tiny_data, capsys, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    out = {"/dev/null": "/dev/null", "dangling link": str(tmp_path / "dangling"), "loop": str(tmp_path / "loop1"),
           "empty": ""}[where]
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    code, _, err = run_cli([*TRAIN, "--out", out], capsys)
    assert_one_line_error(code, err, f"--out {out}" if out else "--out '': an empty path")
    assert not (tmp_path / "nowhere").exists() and not Path("runs").exists()


# ----------------------------------------------------------------------------- hangs and bounds


@pytest.mark.parametrize("name", [LOCK, "config.json"])
def test_a_fifo_in_a_run_never_hangs(run_copy, tmp_path, name):
    (run_copy / name).unlink()
    os.mkfifo(run_copy / name)
    result = gpulab_subprocess(["train", "--resume", str(run_copy)], tmp_path, timeout=scaled(60))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "not a regular file" in lines[0], result.stderr


@pytest.mark.parametrize("plant", ["fifo", "endless"])
def test_metrics_json_that_is_no_file_is_rewritten_never_read_without_end(run_copy, tmp_path, plant):
    """metrics.json is read on --resume to see whether it is behind the checkpoint: a FIFO there
    hung the run forever, a link to /dev/zero read without end; either is passed over, and the
    metrics are written again from the checkpoint (a new file in place of the link)."""
    (run_copy / "metrics.json").unlink()
    if plant == "fifo":
        os.mkfifo(run_copy / "metrics.json")
    else:
        (run_copy / "metrics.json").symlink_to("/dev/zero")
    # the run is complete: --resume reads the metrics, finds them behind the checkpoint, writes them again
    result = gpulab_subprocess(["train", "--resume", str(run_copy)], tmp_path, timeout=scaled(120))
    assert result.returncode == 0 and "is complete" in result.stdout, result.stderr[-2000:]
    assert [row["epoch"] for row in json.loads((run_copy / "metrics.json").read_text())] == [1]


def test_config_json_linked_to_an_endless_file_is_one_line(run_copy, capsys):
    (run_copy / "config.json").unlink()
    (run_copy / "config.json").symlink_to("/dev/zero")
    code, _, err = run_cli(["train", "--resume", str(run_copy)], capsys)
    assert_one_line_error(code, err, "no readable config.json (it is a link)")


def test_config_json_larger_than_any_config_is_not_read_whole(run_copy, capsys):
    (run_copy / "config.json").write_text(json.dumps({"model": "lenet", "pad": "x" * (2 << 20)}))
    code, _, err = run_cli(["train", "--resume", str(run_copy)], capsys)
    assert_one_line_error(code, err, "no readable config.json (larger than")


# ----------------------------------------------------------------------------- one line


@pytest.mark.parametrize("content, words", [
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
    (b"{\"model\": ", "not valid JSON"),
])
def test_a_config_json_that_is_not_one_is_one_line(run_copy, tmp_path, capsys, content, words):
    (run_copy / "config.json").write_bytes(content)
    for argv in readers(run_copy, tmp_path):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, words)


@pytest.mark.parametrize("field, value", [
    ("epoch", "1"), ("epoch", 1.5), ("epoch", -1), ("epoch", True), ("epoch", 2), ("history", [1]),
    ("history", [{"train_loss": 1.0}]), ("history", [{"epoch": "1"}]), ("history", [{"epoch": 1, "loss": torch.ones(1)}]),
])
def test_a_checkpoint_with_values_gpulab_never_saves_is_one_line(run_copy, tmp_path, capsys, field, value):
    """Right keys, wrong values (an epoch that is text, a history of numbers): each was a traceback
    somewhere in the resume, or trained "epoch 0" with a negative learning rate. The reader says it
    (one case through the command, the rest to the reader itself)."""
    from gpulab.train.rundir import RunDir

    checkpoint = torch.load(run_copy / CHECKPOINT, weights_only=True)
    checkpoint[field] = value
    torch.save(checkpoint, run_copy / CHECKPOINT)
    if (field, value) == ("epoch", "1"):
        code, _, err = run_cli(["train", "--resume", str(run_copy), "--epochs", "2"], capsys)
        assert_one_line_error(code, err, f"{CHECKPOINT} is not a gpulab checkpoint")
    else:
        with pytest.raises(UserError, match=f"{CHECKPOINT} is not a gpulab checkpoint"):
            RunDir(run_copy).load_checkpoint()


@pytest.mark.parametrize("field, value, expected", [
    ("model", 123, "not text"), ("model", None, "not text"), ("epochs", 2.0, "not a whole number"),
    ("epochs", 1.5, "not a whole number"), ("batch_size", 2.5, "not a whole number"), ("devices", 123, "not text"),
    ("lr", "0.1", "not a number or null"), ("sync_bn", "yes", "not true or false"),
    ("input_shape", [1, "28"], "not a list of whole numbers"), ("recipe", ["modern"], "not one of modern, textbook"),
])
def test_a_field_of_the_wrong_type_is_one_line(run_copy, tmp_path, capsys, field, value, expected):
    edit_config(run_copy, **{field: value})
    for argv in (["export", str(run_copy), "--out", str(tmp_path / "m.onnx")], ["train", "--resume", str(run_copy)]):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, f"config.json: {field} is {json.dumps(value)}, {expected}")


@pytest.mark.parametrize("variables, named", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE=abc"),
    ({"WORLD_SIZE": "2", "RANK": "abc"}, "RANK=abc"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "abc"}, "LOCAL_WORLD_SIZE=abc"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2"),
])
def test_torchrun_s_variables_that_are_not_numbers_are_one_line(tiny_data, tmp_path, capsys, monkeypatch,
                                                                variables, named):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    code, _, err = run_cli([*TRAIN, "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and err.count("\n") == 1 and named in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_the_collective_timeout_is_bounded(capsys):
    code, _, err = run_cli([*TRAIN, "--timeout", "1e300"], capsys)
    assert_one_line_error(code, err, "--timeout 1e+300", "at most")
    longest = TrainConfig(timeout=24 * 3600).timeout  # the longest accepted: a timedelta torch can take
    assert timedelta(seconds=longest) == timedelta(days=1)
    with pytest.raises(UserError, match="at most"):
        TrainConfig(timeout=24 * 3600 + 1)
