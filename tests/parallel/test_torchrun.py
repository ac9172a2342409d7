"""`gpulab train` under torchrun, as a user runs it: gloo on loopback, 2-3 processes, tiny data.

Covers: rank 0 alone prints and writes; K ranks train like one process; two "machines" (two
torchrun agents, --nnodes 2) compute exactly what one machine does; a rank killed mid-epoch
stops the others in bounded time with a message naming it, and --resume (the run directory on
the first machine only) ends with the weights of an uninterrupted run; NaN on one rank stops all;
a run resumed with another world size; `gpulab launch` and its start-up errors.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from gpulab import models
from gpulab.cli import main
from gpulab.export import load_run
from gpulab.parallel.launch import exit_code
from gpulab.train import TrainConfig, train
from gpulab.train.rundir import CHECKPOINT
from tests.conftest import make_idx_dataset, scaled

FAST = ["--precision", "fp32", "--batch-size", "32"]
PLANT = Path(__file__).parent / "plant"  # sitecustomize.py: a rank that waits to be killed (GPULAB_TEST_PAUSE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, train_args: list[str], nnodes: int = 1, node_rank: int = 0, port: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
                "--master-port", str(port)]
    return [*cmd, "-m", "gpulab", "train", *train_args]


def env_for(data: Path, pause: tuple[int, int, Path] | None = None) -> dict:
    """The ranks' environment: one thread each, `data` as $GPULAB_DATA; with `pause` (rank, step,
    marker file), that rank stops after its step-th optimizer step and waits to be killed
    (plant/sitecustomize.py), the marker written once it waits."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPULAB_DATA": str(data)}
    if pause:
        rank, step, marker = pause
        env["GPULAB_TEST_PAUSE"] = f"{rank}:{step}:{marker}"
        env["PYTHONPATH"] = os.pathsep.join([str(PLANT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def torchrun(nproc: int, train_args: list[str], data: Path, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(nproc, train_args), cwd=cwd, env=env_for(data), capture_output=True, text=True,
                          timeout=scaled(timeout))


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("gpulab: error:")]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / CHECKPOINT, map_location="cpu", weights_only=False)["strategy"]["model"]


def metrics(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "metrics.json").read_text())


# The tests of replicated training (--sync gpulab) compare with one pair of runs, made once: 2
# epochs on tiny_data's dataset (the same files: same seed and sizes), seed 3, fp32, batch 32 (16
# steps an epoch).
ARGS = ["--epochs", "2", "--seed", "3", *FAST]
IN_EPOCH_2 = 16 + 4  # optimizer steps: a rank paused after them waits in step 5 of epoch 2, epoch 1 saved


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> dict:
    """{"one": the run in one process, "two": on 2 ranks started by `gpulab launch -n 2` (torchrun
    underneath; no --out: rank 0 picks runs/<time>-lenet), "stdout": what the 2 ranks printed}."""
    root = tmp_path_factory.mktemp("ddp-reference")
    data = make_idx_dataset(root / "fashion")
    assert main(["train", *ARGS, "--devices", "cpu", "--data-dir", str(data), "--out", str(root / "one")]) == 0
    (root / "job").mkdir()
    result = subprocess.run([sys.executable, "-m", "gpulab", "launch", "-n", "2", "--", *ARGS], cwd=root / "job",
                            env=env_for(data), capture_output=True, text=True, timeout=scaled(180))
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((root / "job" / "runs").iterdir())
    return {"one": root / "one", "two": runs, "stdout": result.stdout}


def test_two_ranks_train_like_one_process_and_only_rank_0_speaks(ddp_runs):
    """Started by `gpulab launch -n 2` (so launch runs train under torchrun)."""
    out = ddp_runs["stdout"]
    assert out.count("training lenet on 2 ranks x [cpu]") == 1
    assert len(re.findall(r"^epoch +\d/2 ", out, re.M)) == 2
    assert out.count("test acc:") == 1
    (two,) = ddp_runs["two"]  # one directory, named once for both ranks
    assert sorted(p.name for p in two.iterdir()) == [
        ".gpulab.lock", "checkpoint.pt", "config.json", "curves.png", "metrics.csv", "metrics.json"
    ]
    one = ddp_runs["one"]
    for a, b in zip(metrics(one), metrics(two)):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-4)
        assert a["test_acc"] == pytest.approx(b["test_acc"], abs=0.01)
    w1, w2 = weights(one), weights(two)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4  # fp32 summation order only
    # Each epoch's peak memory, per rank (each rank is its own process: its peak resident memory).
    for row in metrics(two):
        assert set(row["peak_memory"]) == {"rank 0 cpu", "rank 1 cpu"}
        assert all(50 * 2**20 < n < 4 * 2**30 for n in row["peak_memory"].values())
    assert re.search(r"peak resident memory [\d.]+ [MG]iB on rank 0 cpu, [\d.]+ [MG]iB on rank 1 cpu", out)


def test_check_parity_under_torchrun(tiny_data, tmp_path):
    result = torchrun(3, ["--check-parity", "--batch-size", "31"], tiny_data, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("parity PASS") == 1
    float64 = float(re.search(r"float64 +max \|param difference\| = (\S+)", result.stdout).group(1))
    assert float64 <= 1e-9


# The refusals: each job is start-up and one check, so they run side by side (one by one, each
# would leave a core idle while its processes import torch). name: gpulab train's options.
REFUSED = {
    "several devices": ["--devices", "cpu*2"],
    "epochs 0": ["--epochs", "0"],
    "fsdp sync-bn": ["--shard", "fsdp", "--sync-bn"],
    "fsdp sync-ddp": ["--shard", "fsdp", "--sync", "ddp"],
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """{name: (the 2 ranks' stderr, the --out that must not exist)} for each job of REFUSED."""
    root = tmp_path_factory.mktemp("refused")
    data = make_idx_dataset(root / "fashion")
    jobs = {}
    for i, (name, options) in enumerate(REFUSED.items()):
        out = root / f"run{i}"
        jobs[name] = (subprocess.Popen(torchrun_cmd(2, [*options, "--out", str(out)]), cwd=root, env=env_for(data),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out)
    done = {}
    for name, (job, out) in jobs.items():
        _, err = job.communicate(timeout=scaled(180))
        assert job.returncode != 0, (name, err[-3000:])
        done[name] = (err, out)
    return done


def test_several_devices_per_rank_is_one_clear_error(refused):
    err, out = refused["several devices"]
    lines = error_lines(err)
    assert len(lines) == 1 and "each process drives one" in lines[0]
    assert not out.exists()


def test_bad_option_is_said_once(refused):
    err, _ = refused["epochs 0"]
    assert error_lines(err) == ["gpulab: error: [rank 0] --epochs 0: train for at least 1 epoch"]


# ----------------------------------------------------------------------------- failures


# Where the survivor was when it noticed: in a step, or at an epoch's end (evaluation, checkpoint).
WHERE = r"(epoch \d, step \d+/\d+|end of epoch \d \(evaluation and checkpoint\))"


def wait_for(path: Path, job: subprocess.Popen | None = None, timeout: float = 120) -> None:
    """Until `path` exists (while `job`, if given, still runs)."""
    deadline = time.monotonic() + scaled(timeout)
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        assert job is None or job.poll() is None, f"the job ended before {path} appeared: {job.communicate()[1][-3000:]}"
        time.sleep(0.05)


def worker_with_rank(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "gpulab" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no worker with RANK={rank}")


@pytest.fixture
def long_epochs(make_dataset, tmp_path):
    """Epochs of ~1-2 s (4096 samples, batch 16): long enough to stop a job in the middle of one."""
    return make_dataset(tmp_path / "long", num_train=4096, num_test=256)


def test_killed_rank_on_another_machine_then_resume_from_the_first_machine(tiny_data, tmp_path, ddp_runs):
    """Two torchrun agents (--nnodes 2) stand in for two servers; each has its own working
    directory, and the relative --out exists only on the first."""
    args = [*ARGS, "--out", "runs/job"]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for d in (node0, node1):
        d.mkdir()
    paused = tmp_path / "paused"

    def start(node_rank: int, cwd: Path, port: int, extra: list[str] = (), pause=None) -> subprocess.Popen:
        cmd = torchrun_cmd(1, [*args, *extra] if not extra else list(extra), nnodes=2, node_rank=node_rank, port=port)
        return subprocess.Popen(cmd, cwd=cwd, env=env_for(tiny_data, pause), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    port = free_port()
    first, second = start(0, node0, port), start(1, node1, port, pause=(1, IN_EPOCH_2, paused))
    wait_for(paused, second)
    worker_with_rank(second, 1).kill()  # SIGKILL, in the middle of epoch 2
    killed_at = time.monotonic()
    out0, err0 = first.communicate(timeout=scaled(90))
    stopped_after = time.monotonic() - killed_at
    second.communicate(timeout=scaled(30))
    assert first.returncode != 0 and second.returncode != 0
    assert stopped_after < 30, f"rank 0 needed {stopped_after:.0f} s to stop"
    (line,) = error_lines(err0)
    assert re.search(rf"\[rank 0\] {WHERE}: rank 1 stopped answering", line), line
    assert "--resume runs/job" in line
    assert not (node1 / "runs").exists()  # rank 1 never wrote anything

    port = free_port()
    resumed = [start(0, node0, port, ["--resume", "runs/job"]), start(1, node1, port, ["--resume", "runs/job"])]
    for p in resumed:
        out, err = p.communicate(timeout=scaled(180))
        assert p.returncode == 0, err[-3000:]
    (uninterrupted,) = ddp_runs["two"]  # the same settings, on one machine
    w_resumed, w_reference = weights(node0 / "runs/job"), weights(uninterrupted)
    for name in w_reference:  # two machines and one compute the same thing, bit for bit
        assert torch.equal(w_resumed[name], w_reference[name]), name


def torchrun_script(source: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """A Python script using gpulab's API, run as 2 torchrun ranks; its arguments: a run directory, `args`."""
    script = tmp_path / "job.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         str(tmp_path / "run"), *args],
        capture_output=True, text=True, timeout=scaled(180), env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize("when", ["training", "set-up"])
def test_a_rank_that_fails_on_its_own_is_named_with_its_reason(tmp_path, when):
    t0 = time.monotonic()
    result = torchrun_script(BAD_SAMPLE_JOB, tmp_path, when)
    assert result.returncode != 0 and time.monotonic() - t0 < scaled(60)  # start-up included
    if when == "training":
        expected = r"rank 0 stopped: JobFailed epoch 1, step \d+/\d+: rank 1 failed: ValueError: sample \d+ is corrupt"
    else:  # the image-shape check reads sample 0 on every rank before any collective
        expected = r"rank 0 stopped: SharedError rank 1: ValueError: sample 0 is corrupt"
    assert re.search(expected, result.stdout), result.stdout + result.stderr[-2000:]
    assert "Traceback" in result.stderr and "ValueError: sample" in result.stderr  # rank 1 keeps its own traceback


BAD_SAMPLE_JOB = '''
import os, sys, torch
from gpulab.errors import UserError
from gpulab.parallel.failures import JobFailed
from gpulab.train import TrainConfig, train


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        bad = i == 0 if sys.argv[2] == "set-up" else i != 0
        if os.environ["RANK"] == "1" and bad:  # only rank 1 meets the bad samples
            raise ValueError(f"sample {i} is corrupt")
        return torch.full((1, 28, 28), i / 64.0), i % 10


try:
    train(TrainConfig(devices="cpu", epochs=1, batch_size=64, out=sys.argv[1]), train_data=Samples(), test_data=Samples())
except (JobFailed, UserError) as e:
    print(f"rank {os.environ['RANK']} stopped: {type(e).__name__} {e}", flush=True)
'''


def test_a_dataloader_under_torchrun_trains_like_its_dataset_and_a_job_may_train_twice(tmp_path):
    """Its batch_size is the global batch (the loss weights follow it), and the second train() in
    the same job must not read the first one's keys in the store."""
    result = torchrun_script(TWO_RUNS_JOB, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = weights(tmp_path / "run" / "dataset"), weights(tmp_path / "run" / "loader")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert metrics(tmp_path / "run" / "loader")[0]["replicas"] == 2


TWO_RUNS_JOB = '''
import sys, torch
from gpulab.train import TrainConfig, train

g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(96, 1, 28, 28, generator=g), torch.randint(0, 10, (96,), generator=g))
common = dict(devices="cpu", epochs=1, precision="fp32")
train(TrainConfig(batch_size=16, out=sys.argv[1] + "/dataset", **common), train_data=data, test_data=data)
loader = torch.utils.data.DataLoader(data, batch_size=16)  # --batch-size stays 256: the loader's 16 rules
train(TrainConfig(out=sys.argv[1] + "/loader", **common), train_data=loader, test_data=data)
'''


def test_nan_on_one_rank_stops_every_rank_together(tmp_path):
    result = torchrun_script(NAN_JOB, tmp_path)
    # the two ranks' lines may interleave on the shared pipe: each report ends with a marker
    reports = sorted(re.findall(r"rank (\d) stopped: (\w+) printed_by=(\d) (.*?) <end>", result.stdout))
    assert [r[0] for r in reports] == ["0", "1"], result.stdout + result.stderr[-2000:]
    for _, kind, printed_by, message in reports:
        assert kind == "SharedError" and printed_by == "0" and "training loss became nan" in message


NAN_JOB = '''
import sys, torch
from gpulab.errors import UserError
from gpulab.train import TrainConfig, train

g = torch.Generator().manual_seed(0)
X, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
X[5] = float("nan")  # one sample: it lands in one rank's part of one batch
data = torch.utils.data.TensorDataset(X, y)
try:
    train(TrainConfig(devices="cpu", epochs=2, batch_size=16, precision="fp32", out=sys.argv[1]), train_data=data, test_data=data)
except UserError as e:
    import os
    print(f"rank {os.environ['RANK']} stopped: {type(e).__name__} printed_by={getattr(e, 'printed_by', None)} {e} <end>", flush=True)
'''


def test_resume_with_another_world_size(tiny_data, tmp_path, ddp_runs):
    """Supported: the global batches do not depend on the number of ranks."""
    cfg = TrainConfig(devices="cpu", epochs=2, seed=3, batch_size=32, precision="fp32", out=str(tmp_path / "run"))

    def stop_after_first_epoch(row):
        if row["epoch"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg, on_epoch_end=stop_after_first_epoch)
    result = torchrun(2, ["--resume", str(tmp_path / "run")], tiny_data, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows, expected = metrics(tmp_path / "run"), metrics(ddp_runs["one"])  # uninterrupted, the same settings
    assert [r["replicas"] for r in rows] == [1, 2]
    assert rows[1]["train_loss"] == pytest.approx(expected[1]["train_loss"], abs=1e-4)


# ----------------------------------------------------------------------------- gpulab launch


def test_launch_rejects_bad_node_settings(capsys):
    assert main(["launch", "-n", "1", "--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29500"]) == 2
    assert "node ranks go from 0 to 1" in capsys.readouterr().err
    assert main(["launch", "-n", "1", "--nnodes", "2"]) == 2
    assert "--master ADDR:PORT" in capsys.readouterr().err
    assert main(["launch", "-n", "1", "--nnodes", "2", "--master", "nohost"]) == 2
    assert "give the first machine's address" in capsys.readouterr().err
    for timeout in ("nan", "inf", "-5", "0.5"):  # were tracebacks, a C++ stack dump, a silent 0
        assert main(["launch", "-n", "1", "--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:29500",
                     "--startup-timeout", timeout]) == 2
        assert f"--startup-timeout {float(timeout):g}: give the seconds to wait for every machine, 1 or more" in \
            capsys.readouterr().err


@pytest.mark.parametrize("codes, expected", [({0: 2, 1: 2}, 2), ({0: 2, 1: 1}, 1), ({1: -9}, 1), ({0: 1}, 1),
                                             ({0: 2, 1: -15}, 2), ({0: -15}, 1), ({0: 1, 1: -15}, 1)])
def test_launch_exits_2_when_every_failed_rank_refused_bad_input(codes, expected):
    """gpulab launch -n 2 -- --epochs 0: each rank says it in one line and exits 2, as gpulab train does -
    also when torchrun's SIGTERM reached a rank on its way out (it was 1 in 2 of 3 runs)."""
    class Failure:
        def __init__(self, code):
            self.exitcode = code

    class Failed:
        failures = {rank: Failure(code) for rank, code in codes.items()}

    assert exit_code(Failed()) == expected


def test_launch_says_when_the_port_is_taken(capsys):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["launch", "-n", "1", "--nnodes", "2", "--master", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"port {port} is already in use" in err and len(err.strip().splitlines()) == 1


def test_launch_says_when_a_node_never_arrives(tmp_path):
    t0 = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "gpulab", "launch", "-n", "1", "--nnodes", "2", "--master", f"127.0.0.1:{free_port()}",
         "--startup-timeout", "3", "--", "--epochs", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=scaled(120),
    )
    assert result.returncode == 2 and time.monotonic() - t0 < scaled(60)  # start-up included
    assert error_lines(result.stderr) and "not every machine joined within 3 s" in error_lines(result.stderr)[-1]


def test_a_rank_whose_peers_never_come_says_so(monkeypatch):
    """Started by hand with WORLD_SIZE=2 and no rank 1: one line within the start-up timeout."""
    from datetime import timedelta

    from gpulab.errors import UserError
    from gpulab.parallel import world

    monkeypatch.setattr(world, "STARTUP_TIMEOUT", timedelta(seconds=2))
    for name, value in dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    threads, t0 = torch.get_num_threads(), time.monotonic()
    try:
        with pytest.raises(UserError, match="rank 0 of 2 could not join the job's rendezvous at 127.0.0.1:.* within 2 s"):
            world.from_environment()
    finally:
        torch.set_num_threads(threads)  # a rank takes its share of the cores: give this process its own back
    assert time.monotonic() - t0 < 30


def test_sigterm_from_a_scheduler_stops_every_rank_with_one_line(long_epochs, tmp_path):
    """What `timeout`, Slurm or Kubernetes send: torchrun passes it on, each rank stops cleanly."""
    job = subprocess.Popen(
        [sys.executable, "-m", "gpulab", "launch", "-n", "2", "--", "--epochs", "3", "--batch-size", "16",
         "--out", str(tmp_path / "run")],
        cwd=tmp_path, env=env_for(long_epochs), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    wait_for(tmp_path / "run" / "metrics.json")  # epoch 1 is saved
    time.sleep(0.5)
    job.terminate()
    t0 = time.monotonic()
    _, err = job.communicate(timeout=scaled(60))
    assert job.returncode != 0 and time.monotonic() - t0 < 30
    lines = error_lines(err)
    assert len(lines) == 1 and "stopped by SIGTERM" in lines[0], err[-2000:]
    assert "Traceback" not in err and job.returncode == 128 + 15
    assert torch.load(tmp_path / "run" / CHECKPOINT, weights_only=False)["epoch"] >= 1
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path / "run") in " ".join(p.info["cmdline"] or [])]


def test_two_agents_started_with_different_options_are_refused_at_once(tiny_data, tmp_path):
    """Two torchrun agents, one given --epochs 2 and --lr 0.05: before this, rank 1 said "rank 0
    stopped answering" 20 s in while agent 0 waited until killed (issue 27)."""
    port = free_port()
    started = time.monotonic()
    agents = [subprocess.Popen(torchrun_cmd(1, [*FAST, "--out", str(tmp_path / "run"), *extra], nnodes=2,
                                            node_rank=node_rank, port=port),
                               cwd=tmp_path, env=env_for(tiny_data), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for node_rank, extra in ((0, ["--epochs", "1"]), (1, ["--epochs", "2", "--lr", "0.05"]))]
    errs = [a.communicate(timeout=scaled(120))[1] for a in agents]
    took = time.monotonic() - started
    assert all(a.returncode != 0 for a in agents)
    lines = error_lines(errs[0]) + error_lines(errs[1])
    assert len(lines) == 1, errs  # said once, by rank 0
    assert ("the ranks were started with different gpulab train options: --epochs 1 on rank 0 but 2 on rank 1; "
            "--lr (default) on rank 0 but 0.05 on rank 1; start every rank with the same ones") in lines[0]
    assert not (tmp_path / "run").exists()  # nothing written
    assert took < scaled(60), took  # start-up included (torch imported by 2 agents and 2 ranks on 2 cores)


def test_a_full_disk_at_the_first_checkpoint_is_said_truly_by_every_rank(tiny_data, tmp_path):
    """Rank 0 cannot write the first checkpoint. Before, rank 1 said "Last checkpoint: epoch 1 ...
    --resume" while rank 0 rightly said there was none (issue 27): rank 1 cannot know whether rank 0
    wrote it, and says both ways on."""
    result = torchrun_script(FULL_DISK_JOB, tmp_path)
    run = tmp_path / "run"
    assert result.returncode != 0
    lines = error_lines(result.stderr)
    assert [line[:len("gpulab: error: [rank 0]")] for line in lines] == ["gpulab: error: [rank 0]",
                                                                          "gpulab: error: [rank 1]"], result.stderr[-3000:]
    assert lines[0].endswith("(No space left on device); no checkpoint was saved yet: free space, then start over with "
                             "the same torchrun command")
    assert lines[1].endswith(f"Rank 0 was writing the first checkpoint (epoch 1): if {run / CHECKPOINT} exists, continue "
                             f"with the same torchrun command with gpulab train --resume {run}; if not, start over with "
                             f"the same torchrun command")
    assert "Last checkpoint" not in result.stderr and not (run / CHECKPOINT).exists()


FULL_DISK_JOB = '''
import errno, os, sys
from gpulab import models
from gpulab.cli import main
from gpulab.export import load_run
from gpulab.train import rundir

def full(path, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

if os.environ["RANK"] == "0":  # the rank that writes the checkpoint meets a full disk
    rundir.atomic_write_bytes = full
sys.exit(main(["train", "--devices", "cpu", "--epochs", "1", "--precision", "fp32", "--batch-size", "32",
               "--out", sys.argv[1]]))
'''


def test_under_launch_a_dead_rank_stops_the_others_and_is_named_in_launch_s_words(tiny_data, tmp_path):
    """Rank 2 of 3 is killed in epoch 2. torchrun's agent also sends SIGTERM to the survivors; they
    still say who failed, once, in gpulab launch's words (not torchrun's): launch is what the user
    runs again. Epoch 1's checkpoint is intact."""
    run, paused = tmp_path / "run", tmp_path / "paused"
    job = subprocess.Popen(
        [sys.executable, "-m", "gpulab", "launch", "-n", "3", "--", *ARGS, "--out", str(run)],
        cwd=tmp_path, env=env_for(tiny_data, (2, IN_EPOCH_2, paused)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(paused, job)
    rank_2 = worker_with_rank(job, 2)
    assert rank_2.environ().get("GPULAB_LAUNCH") == "1"
    rank_2.kill()  # SIGKILL, in the middle of epoch 2
    killed_at = time.monotonic()
    out, err = job.communicate(timeout=scaled(90))
    assert job.returncode != 0 and time.monotonic() - killed_at < 30
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    assert re.search(rf"{WHERE}: rank 2 stopped answering \(gpulab launch's last line shows how it exited\)\. "
                     rf"Last checkpoint: epoch \d, in {re.escape(str(run))}; continue with gpulab launch \(the same "
                     rf"options\) -- --resume {re.escape(str(run))}$", lines[0]), lines[0]
    assert "torchrun" not in lines[0]
    assert "gpulab launch: rank 2 was killed by SIGKILL" in out
    assert torch.load(run / CHECKPOINT, weights_only=False)["epoch"] >= 1  # intact


def test_ranks_stop_when_gpulab_launch_is_killed_outright(tiny_data, tmp_path):
    """SIGKILL to gpulab launch (torchrun's agent runs in it): its ranks trained on to the end,
    unsupervised. Each now gets SIGTERM when its parent dies, and stops as torchrun's stop makes it."""
    paused = tmp_path / "paused"
    job = subprocess.Popen([sys.executable, "-m", "gpulab", "launch", "-n", "2", "--", *ARGS, "--out", str(tmp_path / "run")],
                           cwd=tmp_path, env=env_for(tiny_data, (1, 3, paused)), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    wait_for(paused, job)
    ranks = [worker_with_rank(job, r) for r in (0, 1)]
    job.kill()
    job.communicate(timeout=scaled(30))
    _, alive = psutil.wait_procs(ranks, timeout=scaled(20))
    for p in alive + planted_ranks(paused):  # whatever the outcome, no rank outlives the test
        p.kill()
    assert not alive, f"ranks {[p.pid for p in alive]} outlived gpulab launch"


def planted_ranks(marker: Path) -> list[psutil.Process]:
    """The processes started with the pause planted at `marker` (env_for), wherever they are now."""
    found = []
    for p in psutil.process_iter():
        try:
            if str(marker) in p.environ().get("GPULAB_TEST_PAUSE", ""):
                found.append(p)
        except psutil.Error:
            continue
    return found


# ----------------------------------------------------------------------------- --shard fsdp


# The FSDP tests compare with one pair of runs, made once: 2 epochs on tiny_data's dataset (the
# same files: same seed and sizes), seed 3, fp32, batch 32 (16 steps an epoch), NCHW in both
# (FSDP2 shards contiguous parameters only, and a layout's rounding flips near-ties in a barely
# trained model's test accuracy).
FSDP_ARGS = [*ARGS, "--channels-last", "off"]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict:
    """{"one": the run in one process, "fsdp": sharded over 2 torchrun ranks (FSDP2), with --profile
    on rank 0, "stdout": what the sharded run printed}."""
    root = tmp_path_factory.mktemp("fsdp-reference")
    data = make_idx_dataset(root / "fashion")
    assert main(["train", *FSDP_ARGS, "--devices", "cpu", "--data-dir", str(data), "--out", str(root / "one")]) == 0
    result = torchrun(2, [*FSDP_ARGS, "--shard", "fsdp", "--profile", "--out", str(root / "fsdp")], data, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"one": root / "one", "fsdp": root / "fsdp", "stdout": result.stdout}


def test_fsdp_trains_like_one_process_and_exports(fsdp_runs, tmp_path):
    """Sharded over 2 ranks (FSDP2): the same losses, accuracy and weights as one process, up to
    fp32 summation order; each rank writes its shard of the checkpoint, and export gathers the
    model from the shards in one process."""
    one, fsdp = fsdp_runs["one"], fsdp_runs["fsdp"]
    assert "shard fsdp over gloo" in fsdp_runs["stdout"]
    for a, b in zip(metrics(one), metrics(fsdp)):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-4)
        assert a["test_acc"] == pytest.approx(b["test_acc"], abs=0.01)
    # every rank wrote its shard of each epoch; checkpoint.pt names the last folder, the older is gone
    assert torch.load(fsdp / CHECKPOINT, weights_only=False)["strategy"] == {"shards": "checkpoint-epoch2.dcp"}
    assert sorted(p.name for p in fsdp.glob("checkpoint*")) == ["checkpoint-epoch2.dcp", CHECKPOINT]
    assert len(list((fsdp / "checkpoint-epoch2.dcp").glob("*.distcp"))) == 2
    w1, (_, w2, _) = weights(one), load_run(fsdp)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4
    assert main(["export", str(fsdp), "--out", str(tmp_path / "model.onnx")]) == 0


def test_fsdp_check_parity_on_three_ranks(tiny_data, tmp_path):
    result = torchrun(3, ["--check-parity", "--shard", "fsdp", "--batch-size", "31"], tiny_data, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("parity PASS") == 1 and "shard fsdp" in result.stdout
    float64 = float(re.search(r"float64 +max \|param difference\| = (\S+)", result.stdout).group(1))
    assert float64 <= 1e-9


@pytest.mark.parametrize("name, words", [
    ("fsdp sync-bn", "--sync-bn with --shard fsdp is not supported"),
    ("fsdp sync-ddp", "--sync ddp replicates the model"),
])
def test_fsdp_refuses_what_it_cannot_do_in_one_line(refused, name, words):
    err, out = refused[name]
    lines = error_lines(err)
    assert len(lines) == 1 and words in lines[0], err[-2000:]
    assert not out.exists()


def test_a_rank_stuck_in_its_own_code_is_named_where_it_is(tiny_data, tmp_path):
    """Rank 1 hangs outside any collective (in its own code: here the plant's sleep after its 3rd
    step); rank 0's collective times out. Rank 1 still answers the check-in (its watchdog does), so
    it was never named: rank 0 said only that a collective failed. It now names rank 1 and where."""
    paused = tmp_path / "paused"
    job = subprocess.Popen(torchrun_cmd(2, [*ARGS, "--timeout", "3", "--out", str(tmp_path / "run")]), cwd=tmp_path,
                           env=env_for(tiny_data, (1, 3, paused)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    _, err = job.communicate(timeout=scaled(120))
    assert paused.exists() and job.returncode != 0
    lines = [line for line in error_lines(err) if "[rank 0]" in line]
    assert len(lines) == 1 and re.search(
        rf"{WHERE}: rank 1 never reached the collective: it is stuck at sitecustomize\.py:\d+ in _pause, outside torch "
        r"and gpulab \(the collective failed: ", lines[0]), err[-2000:]


def test_fsdp_outside_torchrun_is_refused_in_one_line(tiny_data, tmp_path, capsys):
    assert main(["train", "--shard", "fsdp", "--out", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--shard fsdp shards the model over torchrun ranks" in line
    assert not (tmp_path / "run").exists()


def test_fsdp_killed_rank_stops_the_others_then_the_run_resumes_on_three_ranks(tiny_data, tmp_path, fsdp_runs):
    """Rank 1 of 2 is killed in epoch 2; the run resumes from epoch 1's shards on 3 ranks (SGD with
    momentum: optimizer state too): the shards are made again from the whole state, and the run
    ends as the uninterrupted one."""
    args = [*FSDP_ARGS, "--shard", "fsdp", "--timeout", "15"]
    paused = tmp_path / "paused"
    job = subprocess.Popen(torchrun_cmd(2, [*args, "--out", str(tmp_path / "run")]), cwd=tmp_path,
                           env=env_for(tiny_data, (1, IN_EPOCH_2, paused)), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    wait_for(paused, job)  # epoch 1 is saved
    worker_with_rank(job, 1).kill()  # SIGKILL, in the middle of epoch 2
    killed_at = time.monotonic()
    _, err = job.communicate(timeout=scaled(90))
    assert job.returncode != 0 and time.monotonic() - killed_at < 30
    lines = error_lines(err)
    assert len(lines) == 1 and re.search(rf"{WHERE}: rank 1 stopped answering", lines[0]), err[-2000:]
    resumed = torchrun(3, ["--resume", str(tmp_path / "run")], tiny_data, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows, expected = metrics(tmp_path / "run"), metrics(fsdp_runs["fsdp"])  # uninterrupted, on 2 ranks
    assert [r["replicas"] for r in rows] == [2, 3]
    assert rows[-1]["train_loss"] == pytest.approx(expected[-1]["train_loss"], abs=1e-4)


KILLED_DURING_THE_SECOND_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint as dcp
from gpulab.train import TrainConfig, train

real_save = dcp.save


def save(state, checkpoint_id, process_group):
    if os.environ["RANK"] == "1" and checkpoint_id.endswith("checkpoint-epoch2.dcp"):
        os.kill(os.getpid(), signal.SIGKILL)  # planted: rank 1 dies as epoch 2's checkpoint is saved
    return real_save(state, checkpoint_id=checkpoint_id, process_group=process_group)


dcp.save = save
train(TrainConfig(epochs=2, seed=3, precision="fp32", batch_size=32, channels_last="off", shard="fsdp", timeout=10,
                  out=sys.argv[1]))
"""


def test_fsdp_killed_during_a_checkpoint_save_resumes_from_the_one_before(tiny_data, tmp_path, fsdp_runs):
    """Rank 1 dies as the last epoch's checkpoint is saved: the run resumes from epoch 1's and ends as
    the uninterrupted run (fsdp_runs: the same settings)."""
    result = torchrun_script(KILLED_DURING_THE_SECOND_SAVE, tmp_path)
    assert result.returncode != 0
    run = tmp_path / "run"
    saved = torch.load(run / CHECKPOINT, weights_only=False)
    assert saved["epoch"] == 1 and saved["strategy"] == {"shards": "checkpoint-epoch1.dcp"}
    resumed = torchrun(2, ["--resume", str(run)], tiny_data, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["epoch"] for r in metrics(run)] == [1, 2]
    assert sorted(p.name for p in run.glob("checkpoint-epoch*")) == ["checkpoint-epoch2.dcp"]
    assert metrics(run)[-1]["train_loss"] == pytest.approx(metrics(fsdp_runs["fsdp"])[-1]["train_loss"], abs=1e-6)


def fsdp_in_bf16(data: Path, tmp_path: Path, batch_size: int, timeout: float = 180) -> None:
    """FSDP's bf16 policy casts parameters, not buffers: BatchNorm (ResNet-18's) is sharded on its
    own in fp32, else batch_norm refuses bf16 weights beside fp32 running statistics (in the first
    training step's forward, and in evaluation)."""
    result = torchrun(2, ["--model", "resnet18", "--precision", "bf16", "--shard", "fsdp", "--epochs", "1",
                          "--batch-size", str(batch_size), "--out", str(tmp_path / "run")], data, cwd=tmp_path,
                      timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bf16 (FSDP's mixed precision), shard fsdp over gloo (10 units + root); bfloat16 parameters gathered" in result.stdout
    assert [r["epoch"] for r in metrics(tmp_path / "run")] == [1]  # trained, evaluated and saved


def test_fsdp_in_bf16_keeps_batchnorm_in_fp32(make_dataset, tmp_path):
    """One step of 4 images (2 per rank) and 4 to evaluate: each BatchNorm meets bf16 in training
    and in evaluation, as in a whole epoch (below), in ~10 s instead of 3 minutes where bf16 is
    emulated (no native bf16: ~3 samples/s for ResNet-18 on 2 ranks)."""
    fsdp_in_bf16(make_dataset(tmp_path / "four", num_train=4, num_test=4), tmp_path, batch_size=4)


def test_fsdp_in_bf16_takes_a_batchnorm_that_is_a_unit_of_its_own(make_dataset, tmp_path):
    """A model whose top-level children include BatchNorm: the bf16 policy shards each BatchNorm on
    its own in fp32, and then the units - that same BatchNorm again: 'fully_shard has already been
    applied' (a helper's finding, a Sequential of Conv2d, BatchNorm2d, ...)."""
    (tmp_path / "bnmodel.py").write_text(
        "from torch import nn\n\n"
        "def small():\n"
        "    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(2),\n"
        "                         nn.Flatten(), nn.Linear(16, 10))\n")
    data = make_dataset(tmp_path / "four", num_train=8, num_test=4)
    env = {**env_for(data), "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(torchrun_cmd(2, ["--model", "bnmodel:small", "--precision", "bf16", "--shard", "fsdp",
                                             "--epochs", "1", "--batch-size", "4", "--out", str(tmp_path / "run")]),
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(180))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["epoch"] for r in metrics(tmp_path / "run")] == [1]


@pytest.mark.slow
def test_fsdp_in_bf16_keeps_batchnorm_in_fp32_for_an_epoch(tiny_data, tmp_path):
    """The same over 16 steps of 32 (512 images) and 256 evaluated: 3 minutes and more on 2 cores
    without native bf16."""
    fsdp_in_bf16(tiny_data, tmp_path, batch_size=32, timeout=900)


def test_the_profiler_measures_a_sharded_step_s_memory(fsdp_runs):
    """`--profile` on rank 0 of an FSDP run (fsdp_runs: its numbers are the unprofiled one-process
    run's, test_fsdp_trains_like_one_process_and_exports): the memory window reads each rank's
    shards (DTensors' local parts) and skips the storages FSDP freed after a unit ran."""
    measured = json.loads((fsdp_runs["fsdp"] / "profile" / "report.json").read_text())["memory"]
    assert "error" not in measured, measured
    whole = sum(p.numel() * p.element_size() for p in models.build("lenet").parameters())
    assert measured["sizes"]["parameters"] == pytest.approx(whole / 2, rel=0.01)  # this rank's half
    assert measured["sizes"]["optimizer_state"] == pytest.approx(whole / 2, rel=0.01)  # SGD momentum, sharded
