"""`gpulab profile` under the frameworks people train with and the launchers they use (issue 28):
the evidence names the DataLoader the steps trained on, with the line that built it and its real
batch size; every rank of a job is a rank however it was started; the patches keep the signatures
frameworks introspect, so `--try` works under Lightning's DDP.

The scripts (tests/monitor/scripts/frameworks/, ddp_spawned.py) print their own truth - their
rank from torch.distributed, their steps, the batch sizes they trained on - and the tests hold
the report to it. The framework tests skip where the `frameworks` extra is not installed.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import multiprocessing.process
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

import gpulab.monitor
from gpulab.cli import main
from tests.monitor.reports import read_report

SCRIPTS = Path(__file__).parent / "scripts"
FRAMEWORKS = SCRIPTS / "frameworks"


def needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install -e '.[frameworks]')")


def profile(tmp_path: Path, script: Path, *args: str, options: tuple[str, ...] = ()) -> tuple[int, Path]:
    out = tmp_path / "prof"
    code = main(["profile", "--out", str(out), *options, "--", sys.executable, str(script), *args])
    return code, out


def marked_line(script: Path, marker: str) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if marker in line)


def site(script: Path, marker: str) -> str:
    """The end of the marked line's `path:line` (the report's path is relative to the working directory)."""
    return f"{script.parent.name}/{script.name}:{marked_line(script, marker)}"


def finding(report: dict, cause: str) -> dict:
    return next(f for f in report["findings"] if f["cause"] == cause)


def printed(text: str, script: str) -> list[dict[str, str]]:
    """The truth lines a script printed ("name: key value key value ...")."""
    return [dict(re.findall(r"(\w+) (\[[^]]*\]|\S+)", line.split(": ", 1)[1]))
            for line in text.splitlines() if line.startswith(f"{script}: ")]


# ----------------------------------------------------------------------------- patches keep signatures


PATCHED = {
    "DataLoader.__init__": lambda: DataLoader.__init__,
    "DataLoader.__iter__": lambda: DataLoader.__iter__,
    "next(DataLoader)": lambda: _BaseDataLoaderIter.__next__,
    "torch.autograd.backward": lambda: torch.autograd.backward,
    "torch.autograd.grad": lambda: torch.autograd.grad,
    "Optimizer.zero_grad": lambda: torch.optim.Optimizer.zero_grad,
    "dist.all_reduce": lambda: torch.distributed.all_reduce,
    "dist.init_process_group": lambda: torch.distributed.init_process_group,
    "BaseProcess._bootstrap": lambda: multiprocessing.process.BaseProcess._bootstrap,
}


def test_patched_callables_keep_their_signatures_and_names(tmp_path):
    # Lightning re-creates a DataLoader from inspect.signature(DataLoader.__init__); with --try's
    # overrides in place that read (loader, *args, **kwargs) and it failed: "The missing attributes are ['loader']".
    before = {name: (inspect.signature(get()), get().__name__) for name, get in PATCHED.items()}
    with gpulab.monitor.profile(out=tmp_path, quiet=True, dataloader_overrides={"num_workers": 0}):
        during = {name: (inspect.signature(get()), get().__name__) for name, get in PATCHED.items()}
        patched = {name for name, get in PATCHED.items() if hasattr(get(), "__wrapped__")}
    assert during == before
    assert patched == set(PATCHED)  # each one is patched, and says what it wraps


# ----------------------------------------------------------------------------- the loader in the evidence


class Samples(Dataset):
    def __init__(self, n: int, seconds_per_sample: float = 0.0):
        self.n, self.seconds_per_sample = n, seconds_per_sample

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.seconds_per_sample)
        return torch.randn(8), i % 3


def test_the_evidence_names_the_loader_the_steps_trained_on_not_the_first_iterated(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def evaluate(loader):
        with torch.no_grad():
            for X, _ in loader:
                model(X)

    with gpulab.monitor.profile(out=tmp_path, quiet=True) as p:  # a loader built before it has no line
        train = DataLoader(Samples(12 * 8, 0.001), batch_size=8)  # built: train
        val = DataLoader(Samples(64), batch_size=32)  # built: val
        evaluate(val)  # first, as Lightning's sanity check does
        for X, y in train:
            loss = nn.functional.cross_entropy(model(X), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        evaluate(val)
    evidence = finding(p.report, "input_pipeline")["evidence"]
    assert "DataLoader(batch_size=8, num_workers=0, pin_memory=False) built at " in evidence, evidence
    assert evidence.endswith(site(Path(__file__), "# built: train")), evidence
    fed = {loader["batch_size"]: loader["steps_fed"] for loader in p.report["data_loaders"]}
    assert fed == {32: 0, 8: 12}


def input_evidence(tmp_path, capfd, script: Path, *args: str, steps: int) -> tuple[dict, str]:
    """Profile a single-process framework script that prints its own truth: that truth and the
    input_pipeline finding's evidence, once the run and its step count are checked."""
    code, out = profile(tmp_path, script, *args)
    assert code == 0
    (truth,) = printed(capfd.readouterr().out, script.stem)
    report = read_report(out)
    assert report["steps"] == int(truth["steps"]) == steps
    return truth, finding(report, "input_pipeline")["evidence"]


@needs("accelerate")
@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_accelerate_s_own_loader_is_named_by_the_user_s_line_and_batch_size(tmp_path, capfd):
    # accelerator.prepare() iterates a DataLoader of its own over the user's dataset, with a
    # batch sampler: its batch_size is None (the evidence said "batch_size=None").
    script = FRAMEWORKS / "accelerate_loop.py"
    truth, evidence = input_evidence(tmp_path, capfd, script, "20", steps=20)
    assert truth["batch"] == "[16]" and "DataLoader(batch_size=16," in evidence, evidence
    assert evidence.endswith(site(script, "# built: train")), evidence


@pytest.mark.slow
@needs("transformers")
def test_hf_trainer_s_loader_is_named_by_its_builder_and_the_user_s_line(tmp_path, capfd):
    # The user builds no DataLoader: Trainer builds one, and Accelerate iterates its copy of it.
    script = FRAMEWORKS / "hf_trainer.py"
    truth, evidence = input_evidence(tmp_path, capfd, script, str(tmp_path / "hf"), "16", steps=16)
    assert truth["batch"] == "[16]" and "DataLoader(batch_size=16," in evidence, evidence
    user_line = site(script, "trainer.train()")
    assert re.search(rf"built at transformers/trainer\.py:\d+ \(from \S*{re.escape(user_line)}\)$", evidence), evidence


# ----------------------------------------------------------------------------- ranks however launched


@pytest.mark.slow
@needs("transformers")
def test_hf_trainer_s_torch_compile_recompile_on_a_last_short_batch_has_trainer_s_fix(tmp_path, capfd):
    # TrainingArguments(torch_compile=True); 20 steps, the last of 4 samples: 18 s of recompiling
    # (45% of the run) on a 2-core EPYC, named with the knob Trainer users have
    code, out = profile(tmp_path, FRAMEWORKS / "hf_trainer.py", str(tmp_path / "hf"), "20", "compiled")
    assert code == 0
    (truth,) = printed(capfd.readouterr().out, "hf_trainer")
    assert truth["batch"] == "[4, 16]"
    report = read_report(out)
    (short,) = [f for f in report["findings"] if f["cause"] == "recompile" and "expected 16, actual 4" in f["evidence"]]
    assert "dataloader_drop_last=True" in short["fix"] and short["share"] > 0.05
    assert finding(report, "compile_time")["share"] >= 0.1


def test_ranks_started_by_mp_spawn_are_ranks_and_a_straggler_is_found(tmp_path, capfd):
    script = SCRIPTS / "ddp_spawned.py"
    code, out = profile(tmp_path, script, "slow-data")
    assert code == 0
    truth = printed(capfd.readouterr().out, "ddp_spawned")
    assert [t["RANK"] for t in truth] == ["None", "None"]  # mp.spawn sets no RANK
    report = read_report(out)
    ranks = {p["pid"]: (p["rank"], p["steps"]) for p in report["processes"] if p["rank"] is not None}
    assert ranks == {int(t["pid"]): (int(t["rank"]), int(t["steps"])) for t in truth}
    assert sorted(ranks.values()) == [(0, 40), (1, 40)]
    top = next(f for f in report["findings"] if f["cause"] not in ("cpu_only_torch", "cpu_contention"))
    assert top["cause"] == "straggler" and top["rank"] == 1, report["findings"]
    assert "in data wait than the other ranks" in top["evidence"] and "rank 0 waits for it" in top["evidence"]
    assert top["where"].endswith(f"ddp_spawned.py:{marked_line(script, '# planted:')}")
    assert report["note"].startswith("2 ranks trained")


@needs("lightning")
@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_a_compiled_lightning_module_s_recompile_names_its_training_step_and_the_fix(tmp_path, capfd):
    # torch.compile(model) then trainer.fit, 4 steps (all in the warm-up: too few to judge the loop);
    # the epoch's last batch of 8 recompiles training_step, which Lightning calls, not the script.
    # (aot_eager: the same recompile as inductor's, 6 s for the script against 21 s with a cold cache)
    script = FRAMEWORKS / "lightning_compiled.py"
    code, out = profile(tmp_path, script, "aot_eager")
    assert code == 0
    (truth,) = printed(capfd.readouterr().out, "lightning_compiled")
    assert truth["batch_sizes"] == "[8, 64]"
    report = read_report(out)
    found = finding(report, "recompile")
    assert "size mismatch at index 0. expected 64, actual 8" in found["evidence"]
    assert f"{script.parent.name}/{script.name}:{truth['training_step_line']}) called here" in found["evidence"]
    assert "the compiled training_step (" in found["evidence"]
    assert found["where"].endswith(f"{script.name}:{marked_line(script, 'trainer.fit(')}")
    assert "drop_last=True" in found["fix"] and report["compile"]["compiles"] >= 2


@needs("lightning")
@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_lightning_s_validation_every_few_batches_is_named_with_its_share(tmp_path, capfd):
    # val_check_interval=5 over 40 batches, 20 validation batches each time: the script's own hooks
    # (on_validation_start/end) time it; the report's share of the training time must match, and
    # validation_step - which runs in no steady step - place no steady cost.
    script = FRAMEWORKS / "lightning_validates_often.py"
    code, out = profile(tmp_path, script)
    assert code == 0
    validated_s, total_s = map(float, re.search(r"validated ([\d.]+) s of ([\d.]+) s", capfd.readouterr().out).groups())
    report = read_report(out)
    found = finding(report, "evaluation")
    assert found["share"] == pytest.approx(validated_s / total_s, abs=0.15)
    assert "9 passes" in found["evidence"]  # 8 validations and Lightning's sanity check
    assert found["where"].endswith(f"{script.name}:{marked_line(script, 'trainer.fit(')}")
    assert "val_check_interval" in found["fix"]
    step_line = site(script, "a metric of its own")
    assert not any((f["where"] or "").endswith(step_line) for f in report["findings"])


@pytest.mark.slow
@needs("lightning")
def test_lightning_ddp_ranks_and_its_training_loader(tmp_path, capfd):
    # Lightning starts the second process itself, with no RANK in either environment; it iterates
    # the validation loader (batch 256) first and re-creates both loaders with a DistributedSampler.
    script = FRAMEWORKS / "lightning_loaders.py"
    code, out = profile(tmp_path, script, "ddp")
    assert code == 0
    truth = printed(capfd.readouterr().out, "lightning_loaders")
    report = read_report(out)
    ranks = {p["pid"]: (p["rank"], p["steps"]) for p in report["processes"] if p["rank"] is not None}
    assert ranks == {int(t["pid"]): (int(t["rank"]), int(t["steps"])) for t in truth}
    assert sorted(rank for rank, _ in ranks.values()) == [0, 1]
    assert report["note"].startswith("2 ranks trained")
    evidence = finding(report, "input_pipeline")["evidence"]
    assert {t["batch"] for t in truth} == {"[64]"} and "DataLoader(batch_size=64," in evidence, evidence
    assert evidence.endswith(site(script, "# built: train")), evidence


@pytest.mark.slow
@needs("lightning")
def test_try_num_workers_runs_and_measures_under_lightning_ddp(tmp_path):
    # Before: "MisconfigurationException: ... The missing attributes are ['loader']" on both
    # ranks, then "the run with num_workers=1 ended after 0 measured steps".
    code, out = profile(tmp_path, FRAMEWORKS / "lightning_loaders.py", "ddp",
                        options=("--try", "num_workers=1", "--steps", "10", "--max-pairs", "2"))
    assert code == 0
    result = json.loads((out / "try.json").read_text())
    assert len(result["pairs"]) >= 2 and result["speedup"] > 0
    assert all(run["steps"] >= 10 for run in result["runs"].values())
