"""Plant a known bug, run the tests that should catch it, and say whether they did.

Each mutation is one textual change to gpulab's source, made in a scratch copy of the checkout
(the checkout itself is never touched). A mutation the tests let pass is a hole in the tests.

    .venv/bin/python scripts/mutation_check.py            # every mutation (a few minutes on 2 cores)
    .venv/bin/python scripts/mutation_check.py --list     # what would be planted
    .venv/bin/python scripts/mutation_check.py --only 2   # one of them

Exit status 0 when every mutation was caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARITY_TESTS = ["tests/parallel/test_parity.py"]
TORCHRUN_TESTS = ["tests/parallel/test_distributed.py"]
HOSTILE_RUNS = "tests/hostile/test_run_dirs.py"
HOSTILE_DATA = "tests/hostile/test_data.py"
HOSTILE_OPTIONS = "tests/hostile/test_options.py"
HOSTILE_OUTPUTS = "tests/hostile/test_outputs.py"


@dataclass
class Mutation:
    what: str
    file: str
    old: str
    new: str
    tests: list[str]


MUTATIONS = [
    Mutation("every optimizer update applied twice", "src/gpulab/train/step.py",
             "                    opt.step()\n", "                    opt.step()\n                    opt.step()\n", PARITY_TESTS),
    Mutation("the first gradient bucket left out of the allreduce", "src/gpulab/parallel/allreduce.py",
             "        for b in range(self.num_buckets):\n            allreduce(",
             "        for b in range(1, self.num_buckets):\n            allreduce(", PARITY_TESTS),
    Mutation("each part's loss weighted 1/k instead of its share of the batch", "src/gpulab/train/step.py",
             "return mean * (len(y) / batch), correct", "return mean / len(self.strategy.replicas), correct", PARITY_TESTS),
    Mutation("the learning rate multiplied by the device count", "src/gpulab/train/step.py",
             '                group["lr"] = lr\n', '                group["lr"] = lr * len(self.strategy.devices)\n',
             PARITY_TESTS),
    Mutation("DDP's rank-averaged gradients left averaged (--sync ddp: 1/k too small)", "src/gpulab/parallel/distributed.py",
             "        self.loss_scale = world.world_size  # DDP", "        self.loss_scale = 1  # DDP", TORCHRUN_TESTS),
    Mutation("the last gradient bucket never sent between ranks", "src/gpulab/parallel/distributed.py",
             "            self.handles.append(dist.all_reduce(flat, group=self.group, async_op=True))\n",
             "            if self.next_bucket < self.buckets.num_buckets - 1:\n"
             "                self.handles.append(dist.all_reduce(flat, group=self.group, async_op=True))\n", TORCHRUN_TESTS),
    Mutation("FSDP's rank-averaged gradients left averaged (--shard fsdp: 1/k too small)", "src/gpulab/parallel/sharded.py",
             "        self.loss_scale = world.world_size  # FSDP", "        self.loss_scale = 1  # FSDP", TORCHRUN_TESTS),
    Mutation("a survivor's lost-peer error taken for a failure of its own", "src/gpulab/monitor/alive/failure.py",
             "lost_peer=bool(_LOST_PEER.search(error))", "lost_peer=False", ["tests/monitor/test_failure.py"]),
    Mutation("stack samples counted one period each, not by the wall time they stand for",
             "src/gpulab/monitor/record/probes/stacks.py", "            self._note(frame, seconds, seconds * blocked)\n",
             "            self._note(frame, self.interval_s, self.interval_s * blocked)\n", ["tests/monitor/test_stacks.py"]),
    Mutation("a loader's batch size read from the DataLoader only (None behind a batch sampler)",
             "src/gpulab/monitor/record/probes/loaders.py", "    if loader.batch_size is not None:\n", "    if True:\n",
             ["tests/monitor/test_frameworks.py"]),
    Mutation("the rank from RANK in the environment only (Lightning's, mp.spawn's ranks lost)", "src/gpulab/monitor/events.py",
             "        return rank if rank is not None else self.start.get(\"rank\")", "        return self.start.get(\"rank\")",
             ["tests/monitor/test_frameworks.py"]),
    Mutation("threads waiting for a core never called contended", "src/gpulab/host.py",
             "        return self.share >= CONTENDED_WAIT_SHARE and self.oversubscribed",
             "        return self.share >= CONTENDED_WAIT_SHARE and not self.oversubscribed", ["tests/monitor/test_cpu_use.py"]),
    Mutation("--try calls one pair of runs an answer", "src/gpulab/monitor/parent/trial.py",
             "    if len(ratios) < MIN_PAIRS:\n        return False\n", "    if len(ratios) < 1:\n        return False\n",
             ["tests/monitor/test_trial.py"]),
    Mutation("--try under torchrun names its folder after the launcher's options", "src/gpulab/monitor/parent/trial.py",
             "default_out_dir(training_target(interpreter, target))", "default_out_dir(target)",
             ["tests/monitor/test_trial.py::test_a_trial_under_torchrun_is_named_after_the_script_torchrun_starts"]),
    Mutation("--try measures a run that failed or ended before its steps", "src/gpulab/monitor/parent/trial.py",
             "        if len(times) < self.steps:\n", "        if len(times) < 3:\n",
             ["tests/monitor/test_trial.py::test_a_run_that_cannot_measure_the_change_is_refused_after_it"]),
    Mutation("--try takes Ctrl-C for a run too short", "src/gpulab/monitor/parent/trial.py",
             "        if job.stopped and job.hang is None:\n", "        if False:\n",
             ["tests/monitor/test_profile_jobs.py::test_ctrl_c_ends_a_trial_as_it_ends_a_profile"]),
    Mutation("--try keeps the last of a key given twice", "src/gpulab/monitor/parent/trial.py",
             "        if key in overrides:  # one of the two", "        if False:  # one of the two",
             ["tests/monitor/test_trial.py::test_a_setting_is_tried_once_and_a_number_is_ascii_digits"]),
    Mutation("--try measures a DataLoader setting where there is no DataLoader", "src/gpulab/monitor/parent/trial.py",
             "    if overrides and not loaders:\n", "    if False:\n",
             ["tests/monitor/test_trial.py::test_a_run_that_cannot_measure_the_change_is_refused_after_it"]),
    Mutation("--steps without --try ignored", "src/gpulab/monitor/cli.py",
             "    if given:  # silently ignored", "    if False:  # silently ignored",
             ["tests/monitor/test_trial.py::test_trial_options_without_try_are_refused"]),
    Mutation("a refused profile leaves the folders it made above its output", "src/gpulab/monitor/parent/runner.py",
             "        for folder in made:\n", "        for folder in made[:1]:\n",
             ["tests/monitor/test_trial.py::test_prefetch_factor_on_a_loader_without_workers_is_refused_not_measured",
              "tests/monitor/test_profile_cli.py::test_an_interpreter_that_cannot_start_is_one_line_and_leaves_no_folder"]),
    Mutation("an interpreter that cannot start is a traceback", "src/gpulab/monitor/parent/runner.py",
             "            except OSError as e:  # a file named like an interpreter", "            except ValueError as e:  # a file named like an interpreter",
             ["tests/monitor/test_profile_cli.py::test_an_interpreter_that_cannot_start_is_one_line_and_leaves_no_folder"]),
    Mutation("--check-parity calls BatchNorm over micro-batches a failed parity", "src/gpulab/train/parity_check.py",
             "    if cfg.accumulate > 1:\n", "    if False:\n",
             ["tests/parallel/test_parity.py::test_check_parity_checks_the_batchnorm_mode_asked_for"]),
    Mutation("a model with nothing to train reaches torch.optim", "src/gpulab/models/__init__.py",
             "    if not any(p.requires_grad for p in model.parameters()):\n", "    if False:\n",
             ["tests/train/test_own_model.py::test_cli_bad_model_specs_are_one_line_errors",
              "tests/train/test_own_model.py::test_a_model_with_nothing_to_train_is_refused"]),
    Mutation("a factory that needs arguments is called without them", "src/gpulab/models/__init__.py",
             "        inspect.signature(factory).bind()  # gpulab", "        inspect.signature(factory)  # gpulab",
             ["tests/train/test_own_model.py::test_cli_bad_model_specs_are_one_line_errors"]),
    Mutation("a truncated checkpoint's read error escapes", "src/gpulab/train/rundir.py",
             "        except Exception as e:  # truncated or foreign file: torch raises several types, OSError among them",
             "        except (RuntimeError, ValueError) as e:",
             ["tests/train/test_train.py::test_resume_of_a_damaged_checkpoint_is_a_one_line_error"]),
    Mutation("--resume drops a --model other than the run's", "src/gpulab/train/rundir.py",
             "        if given is not None and saved != given:  # a built-in model", "        if False:  # a built-in model",
             ["tests/test_cli.py::test_resume_refuses_another_model_and_a_parity_check"]),
    Mutation("gpulab launch passes any --startup-timeout to torchrun", "src/gpulab/parallel/launch.py",
             "    if not (math.isfinite(startup_timeout_s) and startup_timeout_s >= 1):", "    if False:",
             ["tests/parallel/test_torchrun.py::test_launch_rejects_bad_node_settings"]),
    Mutation("gpulab launch exits 1 for bad input", "src/gpulab/parallel/launch.py",
             "    return 2 if 2 in codes and codes <= {2, -signal.SIGTERM} else 1", "    return 1",
             ["tests/parallel/test_torchrun.py::test_launch_exits_2_when_every_failed_rank_refused_bad_input"]),
    Mutation("gpulab export --force writes over the run's own files", "src/gpulab/export.py",
             "    if taken and has_lock_file(parent):", "    if False:",
             ["tests/test_export.py::test_out_over_a_file_of_the_run_is_refused_even_with_force"]),
    Mutation("a run started over in place keeps its predecessor's profile", "src/gpulab/train/rundir.py",
             '        OutputFolder(self.path / PROFILE, f"--out {self.path}: {PROFILE}").remove_own()', "        pass",
             ["tests/monitor/test_train_profile.py::test_a_run_started_over_in_place_drops_its_predecessors_profile"]),
    Mutation("removing gpulab's outputs removes the folder with the user's files in it", "src/gpulab/io.py",
             "            self.path.rmdir()\n        except OSError:  # something else is there: kept",
             "            __import__(\"shutil\").rmtree(self.path)\n        except OSError:  # something else is there: kept",
             ["tests/monitor/test_train_profile.py::test_a_run_started_over_in_place_drops_its_predecessors_profile"]),
    Mutation("a run in its first epoch is said to have stopped", "src/gpulab/train/rundir.py",
             "        if who:  # still in its first epoch\n", "        if False:  # still in its first epoch\n",
             ["tests/train/test_rundir.py::test_a_run_still_in_its_first_epoch_is_said_to_be_so"]),
    Mutation("a cpu*K run resumed under torchrun is told to use --devices auto", "src/gpulab/train/resume.py",
             "    if world.world_size > 1 and names_several(cfg.devices):", "    if False:",
             ["tests/train/test_reliability.py::test_a_run_of_several_devices_in_one_process_resumes_in_one_process"]),
    Mutation("a forged outputs record makes a start-over remove files outside the folder", "src/gpulab/io.py",
             '            plain = name == Path(name).name and name not in ("", ".", "..")', "            plain = True",
             ["tests/hostile/test_outputs.py::test_a_forged_record_cannot_make_a_start_over_remove_files_outside_the_profile_folder"]),
    Mutation("gpulab killed outright: the job's children end before its recordings go", "src/gpulab/monitor/record/attach.py",
             "        for _ in range(_REMOVE_TRIES):\n",
             "        psutil.wait_procs([c for c in psutil.Process().children(recursive=True) if c.terminate() or True], timeout=5)\n"
             "        for _ in range(_REMOVE_TRIES):\n",
             ["tests/monitor/test_profile_jobs.py::test_killing_gpulab_outright_stops_the_whole_job"]),
    Mutation("a relative --out is handed to the job as it is", "src/gpulab/monitor/parent/runner.py",
             'events = Path(os.path.abspath(tempfile.mkdtemp(prefix=".events-", dir=out)))',
             'events = Path(tempfile.mkdtemp(prefix=".events-", dir=out))',
             ["tests/monitor/test_profile_jobs.py::test_a_relative_out_records_a_job_whose_processes_change_folders"]),
    Mutation("the recording's SIGTERM handler ends the process when a script's handler calls it", "src/gpulab/monitor/record/lifetime.py",
             "        if signal.getsignal(signum) is not flush_and_die:\n", "        if False:\n",
             ["tests/monitor/test_profile_jobs.py::test_a_script_s_sigterm_handler_that_calls_the_one_it_replaced_runs_as_without_gpulab"]),
    Mutation("a job that exits 0 is given the failure of a child", "src/gpulab/monitor/alive/failure.py",
             "    if exit_code == 0:\n        return None\n", "",
             ["tests/monitor/test_profile_jobs.py::test_a_job_that_exits_0_had_no_failure_whatever_its_children_did"]),
    Mutation("a script that ends with os._exit is said to be killed by SIGKILL", "src/gpulab/monitor/alive/failure.py",
             "    if exit_code is not None and exit_code != _KILLED:", "    if False:",
             ["tests/monitor/test_profile_jobs.py::test_a_script_that_ends_with_os_exit_is_not_said_to_be_killed"]),
    Mutation("two profiles started in the same second share a folder", "src/gpulab/monitor/parent/runner.py",
             "    return next(path for path in candidates if not os.path.lexists(path))", "    return base",
             ["tests/monitor/test_profile_jobs.py::test_jobs_started_in_the_same_second_get_folders_of_their_own"]),
    Mutation("gpulab plan takes --seconds nan", "src/gpulab/plan/planner.py",
             "        if not (math.isfinite(self.profile_seconds) and self.profile_seconds > 0):", "        if False:",
             ["tests/plan/test_plan.py::test_bad_inputs_are_one_line_errors"]),
    Mutation("gpulab plan ignores the K of --devices cpu*K", "src/gpulab/plan/planner.py",
             "    if not _KIND.fullmatch(text):", "    if False:",
             ["tests/plan/test_plan.py::test_bad_inputs_are_one_line_errors"]),
    Mutation("gpulab plan ignores --rounds without --check", "src/gpulab/plan/cli.py",
             "    if not args.check:\n        for option", "    if False:\n        for option",
             ["tests/plan/test_plan.py::test_bad_inputs_are_one_line_errors"]),
    Mutation("a profile() block left by sys.exit(0) is a failure of exit code 1", "src/gpulab/monitor/session.py",
             "        if code is None or code == 0:\n            return 0, None\n", "",
             ["tests/monitor/test_session.py::test_a_block_left_by_sys_exit_or_ctrl_c_ends_as_python_would_end"]),
    Mutation("a script that profiles itself fails under gpulab profile", "src/gpulab/monitor/session.py",
             "        self._recorder = recorder_of_gpulab_profile()\n", "        self._recorder = None\n",
             ["tests/monitor/test_profile_jobs.py::test_a_script_that_profiles_itself_runs_under_gpulab_profile_with_its_step_marks"]),
    Mutation("output that cannot be printed is a traceback", "src/gpulab/cli.py",
             "        if e.errno not in _OUTPUT_LOST:\n", "        if True:\n",
             ["tests/test_cli.py::test_output_that_cannot_be_printed_is_one_line_not_a_traceback"]),
    Mutation("training in a thread of its own is not recorded", "src/gpulab/monitor/record/sink.py",
             "            self.ident = caller\n", "            pass\n",
             ["tests/monitor/test_profile_jobs.py::test_training_in_a_thread_of_its_own_is_recorded"]),
    Mutation("SIGTERM ends gpulab plan at once, its temporary folder and measuring processes left", "src/gpulab/plan/cli.py",
             "    with sigterm_raises():  # its temporary folders and measuring processes go with it\n", "    if True:\n",
             ["tests/plan/test_plan.py::test_sigterm_stops_a_plan_in_one_line_and_leaves_no_process_or_temporary_folder"]),
    Mutation("a sleep between steps is called Python to vectorize", "src/gpulab/monitor/record/probes/stacks.py",
             "            self._blocked[category][where] = self._blocked[category].get(where, 0.0) + blocked\n",
             "            pass\n",
             ["tests/monitor/test_stacks.py::test_a_sleep_is_told_from_a_busy_call_by_the_time_the_thread_was_blocked",
              "tests/monitor/test_profile_cli.py::test_a_wait_between_steps_is_called_a_wait_at_its_line"]),
    Mutation("the stack sampler's SIGALRM ends the script's signal.pause()", "src/gpulab/monitor/record/probes/stacks.py",
             '    patch(signal, "pause", handing_back(lambda: True))\n', "",
             ["tests/monitor/test_stacks.py::test_signal_pause_waits_for_the_scripts_signal_not_the_samplers"]),
    Mutation("Ctrl-Z at a terminal leaves the shell waiting on gpulab, the terminal with the stopped job",
             "src/gpulab/monitor/parent/job.py", "                if self._tty is not None and _stopped(self.proc.pid):\n",
             "                if False:\n",
             ["tests/monitor/test_profile_jobs.py::test_ctrl_z_at_a_terminal_stops_gpulab_with_the_job_and_fg_resumes_both"]),
    Mutation("the time the user stopped the job at the terminal is a stall", "src/gpulab/monitor/alive/stall.py",
             "                  if not any(s[\"t0\"] < until and s[\"t1\"] > since for since, until in suspended)]",
             "                  ]",
             ["tests/monitor/test_profile_jobs.py::test_ctrl_z_at_a_terminal_stops_gpulab_with_the_job_and_fg_resumes_both"]),
    Mutation("workers started again every epoch go unnamed", "src/gpulab/monitor/analyze/process.py",
             "_input_finding(rec, step, b, cores), _restart_finding(rec, step), ", "_input_finding(rec, step, b, cores), ",
             ["tests/monitor/test_diagnose.py::test_workers_that_restart_every_epoch_get_persistent_workers_advice",
              "tests/monitor/test_profile_cli.py::test_workers_started_again_every_epoch_are_named_with_their_share_of_the_training"]),
    Mutation("an epoch's worker start is a stall", "src/gpulab/monitor/alive/stall.py",
             "            and s.get(\"counts\", {}).get(PASS_START_COUNT, 0.0) < 0.5 * step_seconds(s)]", "            ]",
             ["tests/monitor/test_diagnose.py::test_workers_that_restart_every_epoch_get_persistent_workers_advice"]),
    Mutation("a fetch that sleeps gets one worker a spare core", "src/gpulab/monitor/analyze/process.py",
             "    if waits:\n", "    if False:\n",
             ["tests/monitor/test_cpu_use.py::test_a_fetch_that_waits_gets_the_workers_that_keep_up_with_the_step_whatever_the_cores",
              "tests/monitor/test_cpu_use.py::test_a_sleeping_dataset_gets_workers_at_torch_s_default_threads"]),
    Mutation("a loop waiting on a prefetching thread's DataLoader is told to move the wait to a thread",
             "src/gpulab/monitor/analyze/process.py", "    if blocked >= WAITING and prefetcher is not None:", "    if False:",
             ["tests/monitor/test_profile_cli.py::test_a_loop_waiting_on_a_prefetching_thread_s_dataloader_is_input_bound"]),
    Mutation("a hard-linked lock writes the file it shares", "src/gpulab/train/rundir.py",
             "    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:", "    if not stat.S_ISREG(st.st_mode):",
             ["tests/hostile/test_run_dirs.py::test_a_hard_linked_lock_never_writes_the_file_it_shares"]),
    Mutation("a checkpoint's values are taken as they come", "src/gpulab/train/rundir.py",
             "        if not _is_gpulab_checkpoint(checkpoint):",
             "        if not isinstance(checkpoint, dict) or not {\"strategy\", \"history\", \"epoch\"} <= checkpoint.keys():",
             ["tests/hostile/test_run_dirs.py::test_a_checkpoint_with_values_gpulab_never_saves_is_one_line"]),
    Mutation("--resume '' starts a new run", "src/gpulab/cli.py",
             '    if args.resume == "":', "    if False:",
             ["tests/test_cli.py::test_resume_of_an_empty_path_is_refused_not_a_new_run"]),
    Mutation("SIGTERM ends a lone gpulab train without a word", "src/gpulab/train/loop.py",
             "    alone = (sigterm_raises() if", "    alone = (nullcontext() if",
             ["tests/train/test_reliability.py::test_sigterm_to_a_lone_run_says_how_to_go_on_as_ctrl_c_does"]),
    Mutation("--allreduce nccl on CPUs is refused only at the first step", "src/gpulab/parallel/allreduce.py",
             '    if algorithm == "nccl" and len(tensors) > 1 and not nccl_usable(tensors):', "    if False:",
             ["tests/train/test_reliability.py::test_an_allreduce_that_cannot_run_here_is_refused_before_the_run_is_written"]),
    Mutation("gpulab launch exits 1 when torchrun's SIGTERM met a rank refusing bad input", "src/gpulab/parallel/launch.py",
             "    return 2 if 2 in codes and codes <= {2, -signal.SIGTERM} else 1", "    return 2 if codes == {2} else 1",
             ["tests/parallel/test_torchrun.py::test_launch_exits_2_when_every_failed_rank_refused_bad_input"]),
    Mutation("evaluation goes unnamed", "src/gpulab/monitor/analyze/process.py",
             "_restart_finding(rec, step), _evaluation_finding(rec),", "_restart_finding(rec, step),",
             ["tests/monitor/test_profile_cli.py::test_an_evaluation_every_few_steps_is_named_with_its_share_of_the_training",
              "tests/monitor/test_frameworks.py::test_lightning_s_validation_every_few_batches_is_named_with_its_share"]),
    Mutation("a rank stuck in its own code goes unnamed when a collective times out", "src/gpulab/parallel/failures.py",
             "        elif stuck and isinstance(error, PeerLost):", "        elif False:",
             ["tests/parallel/test_torchrun.py::test_a_rank_stuck_in_its_own_code_is_named_where_it_is"]),
    Mutation("--sync ddp in one process is recorded as if it acted", "src/gpulab/train/loop.py",
             "        world.all_or_none(lambda: check_options_apply(cfg, world))\n", "",
             ["tests/test_cli.py::test_options_that_would_do_nothing_here_are_refused_not_recorded"]),
    Mutation("a folder in a result file's place is told to free space", "src/gpulab/io.py",
             "    if error.errno in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY):", "    if False:",
             ["tests/test_io.py::test_a_failed_write_s_remedy_follows_its_cause"]),
    Mutation("ranks train on unsupervised after gpulab launch is killed outright", "src/gpulab/parallel/failures.py",
             "            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)\n", "",
             ["tests/parallel/test_torchrun.py::test_ranks_stop_when_gpulab_launch_is_killed_outright"]),
    Mutation("DDP's allreduce wait charged to compute", "src/gpulab/monitor/record/probes/ddp.py",
             'self._sink.steps.add_closed_span(WAIT_SPAN, "collective", t0, t1)', 'self._sink.steps.add_closed_span(WAIT_SPAN, "compute", t0, t1)',
             ["tests/monitor/test_profile_ddp_steps.py"]),
    Mutation("the exit's wait for gloo's workers does not see a runnable one", "src/gpulab/host.py",
             'quiet = 0 if "R" in states else quiet + 1', "quiet = quiet + 1", ["tests/test_host.py"]),
    Mutation("the exit's wait for gloo's workers has no limit", "src/gpulab/host.py",
             "while quiet < _SETTLE_QUIET and time.monotonic() < deadline:", "while quiet < _SETTLE_QUIET:",
             ["tests/test_host.py"]),
    # issue 33: the profiler reads only what is safe, and never contradicts what it recorded
    Mutation("a finalizer on each gradient there at the memory window's start (what the profiler the H200 crashed under did)",
             "src/gpulab/memory/step.py",
             "        self._grads_at_start = Storages(self.device).add_all(gradients(self.modules, self.optimizers))\n",
             "        self._grads_at_start = Storages(self.device).add_all(gradients(self.modules, self.optimizers))\n"
             "        import weakref; [weakref.finalize(g, int) for g in gradients(self.modules, self.optimizers)]\n",
             ["tests/memory/test_step.py", "tests/monitor/test_profile_safety.py"]),
    Mutation("a gradient backward only added to counted as a new one", "src/gpulab/memory/step.py",
             "            if not there:\n", "            if True:\n", ["tests/memory/test_step.py"]),
    Mutation("a saved tensor's storage never freed in the window's timeline", "src/gpulab/memory/step.py",
             "            if freed_ns is not None and freed_ns <= until_ns:\n                timeline.add(-nbytes, to_perf(freed_ns))\n",
             "", ["tests/memory/test_step.py"]),
    Mutation("a tensor's storage size read as its own bytes (a slice counts as the whole)",
             "src/gpulab/memory/tensors.py", "    return (str(t.device), base), (last + 1) * itemsize",
             "    return (str(t.device), base), t.numel() * itemsize", ["tests/memory/test_tensors.py"]),
    Mutation("cpu_only_torch claimed for a process that died before saying whether it used the GPU",
             "src/gpulab/monitor/analyze/process.py", "    return rec.cuda is not None and not rec.cuda.get(\"devices\")",
             "    return not rec.cuda or not rec.cuda.get(\"devices\")", ["tests/monitor/test_diagnose.py"]),
    Mutation("how steps were found read from the whole-run snapshot only", "src/gpulab/monitor/events.py",
             "        return self._rule or self.facts.get(\"step_rule\")", "        return self.facts.get(\"step_rule\")",
             ["tests/monitor/test_diagnose.py"]),
    Mutation("the copy line chosen by whole-run seconds (the set-up copy wins)", "src/gpulab/monitor/analyze/process.py",
             "    return site.get(\"steady_seconds\", 0.0), site.get(\"steady_count\", 0), site[\"seconds\"], site[\"count\"]",
             "    return site[\"seconds\"], site[\"count\"]", ["tests/monitor/test_diagnose.py"]),
    Mutation("findings drawn from warm-up steps when every later step was in a window", "src/gpulab/monitor/analyze/diagnose.py",
             "    if not whole_run and all(s[\"i\"] < warmup_steps for s in steady):",
             "    if False:", ["tests/monitor/test_diagnose.py"]),
    Mutation("a recorded step's warm-up leaves its momentum behind", "src/gpulab/parallel/graphed.py",
             "                if id(v) not in saved:\n                    v.zero_()",
             "                if id(v) not in saved:\n                    pass", ["tests/parallel/test_graphed.py"]),
    Mutation("the compile probe imports gpulab.compiler inside its own import", "src/gpulab/monitor/record/probes/compiled.py",
             "        self.patches.on_undo(after_import(\"gpulab.compiler\", self._watch_compiles))\n"
             "        self.patches.on_undo(after_import(\"torch._dynamo\", self._import_compiler))",
             "        self.patches.on_undo(after_import(\"torch._dynamo\", lambda d: self._watch_compiles("
             "importlib.import_module(\"gpulab.compiler\"))))",
             ["tests/monitor/test_compile_probe.py::test_gpulab_train_compiled_and_profiled_runs_and_its_compiles_are_apart"]),
    Mutation("the replays of a CUDA graph that recorded an optimizer step not counted as steps",
             "src/gpulab/monitor/record/probes/autograd.py",
             "            if optimizer is not None and sink.here():", "            if False:",
             ["tests/monitor/test_session.py::test_replays_of_a_graph_that_recorded_an_optimizer_step_are_the_steps"]),
    Mutation("auto precision bf16 on every bf16 GPU, recorded step or not", "src/gpulab/train/precision.py",
             "    return torch.bfloat16 if recorded and all(native_bf16(d) for d in devices) else None",
             "    return torch.bfloat16 if all(native_bf16(d) for d in devices) else None",
             ["tests/train/test_train.py::test_auto_precision_on_cuda_is_bf16_only_for_a_recorded_step"]),
    Mutation("the training benchmark's headline crowns the textbook against itself", "src/gpulab/bench/training.py",
             "        ours, theirs = (rows[kind][name][key] for name in (DEFAULT, TEXTBOOK))",
             "        ours, theirs = (rows[kind][name][key] for name in (TEXTBOOK, TEXTBOOK))",
             ["tests/bench/test_training.py::test_the_headline_is_the_demo_s_whole_process_first_and_second_run_against_the_textbook"]),
    Mutation("the textbook's training clock stopped after its evaluation", "src/gpulab/bench/textbook.py",
             "        t1 = time.perf_counter()\n        test_acc.append(accuracy(test_iter, W, device))",
             "        test_acc.append(accuracy(test_iter, W, device))\n        t1 = time.perf_counter()",
             ["tests/bench/test_benchmarks.py::test_the_textbook_s_training_seconds_leave_its_evaluation_out"]),
    Mutation("the kernel floor times the data's gradient too", "src/gpulab/bench/training.py",
             "    x.requires_grad_(call.input_needs_grad)",
             "    x.requires_grad_(True)",
             ["tests/bench/test_benchmarks.py::test_kernel_floor_times_each_layer_s_forward_and_the_gradients_backward_computes"]),
    Mutation("a saturated device's host split read as costs", "src/gpulab/monitor/analyze/process.py",
             "    if b.on_cuda and b.busy / seconds >= 1 - MIN_SHARE:",
             "    if b.on_cuda and b.busy / seconds > 1:",
             ["tests/monitor/test_diagnose.py::test_a_saturated_device_s_host_split_is_said_to_cost_nothing"]),
    Mutation("a run too short to judge its loop loses torch.compile's causes", "src/gpulab/monitor/analyze/diagnose.py",
             "        report[\"findings\"] = with_compile_findings([too_few], compiled)",
             "        report[\"findings\"] = [too_few]",
             ["tests/monitor/test_diagnose.py::test_torch_compile_s_causes_are_named_however_few_steps_the_run_had",
              "tests/monitor/test_frameworks.py::test_a_compiled_lightning_module_s_recompile_names_its_training_step_and_the_fix"]),
    Mutation("a recompile names only the line into the compiled code (trainer.fit)", "src/gpulab/monitor/analyze/compiled.py",
             "    if defined_at and defined_at != group.get(\"where\"):",
             "    if False:",
             ["tests/monitor/test_diagnose.py::test_torch_compile_s_causes_are_named_however_few_steps_the_run_had",
              "tests/monitor/test_frameworks.py::test_a_compiled_lightning_module_s_recompile_names_its_training_step_and_the_fix"]),
    Mutation("a graph skipped past the re-recording limit goes unread (torch's singular 'cudagraph')", "src/gpulab/compiler.py",
             '_CUDAGRAPH_SKIP = re.compile(r"skipping cudagraphs? due to (?P<reason>.*)", re.S)',
             '_CUDAGRAPH_SKIP = re.compile(r"skipping cudagraphs due to (?P<reason>.*)", re.S)',
             ["tests/test_compiler.py::test_a_cuda_graph_recorded_again_is_read_with_what_moved_and_for_which_inputs"]),
    Mutation("a recompile on a module attribute gets the generic fix", "src/gpulab/monitor/analyze/compiled.py",
             '    (re.compile(r"(?:^|; )self\\.(?!training\\b)[\\w.]+ (?:==|!=|is) "), lambda m: (',
             '    (re.compile(r"^never$"), lambda m: (',
             ["tests/monitor/test_diagnose.py::test_a_recompile_on_a_module_attribute_says_to_set_it_once"]),
    Mutation("checkpoint.pt unpickled in full (code it names runs)", "src/gpulab/train/rundir.py",
             'checkpoint = torch.load(f, map_location="cpu", weights_only=True)',
             'checkpoint = torch.load(f, map_location="cpu", weights_only=False)',
             [f"{HOSTILE_RUNS}::test_a_checkpoint_that_names_code_is_refused_unrun"]),
    Mutation("a model's import path read from config.json imported without the user naming it", "src/gpulab/train/rundir.py",
             "if isinstance(saved, str) and models.is_factory(saved) and saved != given:",
             "if False:", [f"{HOSTILE_RUNS}::test_a_model_named_by_import_path_in_config_json_is_never_imported"]),
    Mutation("a sharded checkpoint's .metadata unpickled in full", "src/gpulab/parallel/shard_files.py",
             "metadata = MetadataUnpickler(io.BytesIO(data)).load()", "metadata = pickle.loads(data)",
             [f"{HOSTILE_RUNS}::test_a_sharded_checkpoint_whose_metadata_names_code_is_refused_unless_trusted"]),
    Mutation("a sharded checkpoint's non-tensor values unpickled in full", "src/gpulab/parallel/shard_files.py",
             "allowed = torch.load(value, weights_only=True)", "allowed = torch.load(value, weights_only=False)",
             [f"{HOSTILE_RUNS}::test_a_sharded_value_that_names_code_is_refused"]),
    Mutation("rank messages from the rendezvous store unpickled", "src/gpulab/parallel/world.py",
             "value = json.loads(self.store.get(key))", 'value = __import__("pickle").loads(self.store.get(key))',
             [f"{HOSTILE_RUNS}::test_rank_messages_are_json_never_unpickled"]),
    Mutation("the lock file opened through a link (its target overwritten)", "src/gpulab/train/rundir.py",
             "flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK", "flags = os.O_RDWR | os.O_NONBLOCK",
             [f"{HOSTILE_RUNS}::test_a_run_claimed_through_a_linked_lock_is_refused_at_the_lock"]),
    Mutation("a folder with a run-like config.json but no lock taken for a gpulab run", "src/gpulab/train/rundir.py",
             "    if not has_lock_file(path):\n        return False\n",
             '    if not has_lock_file(path):\n        return (path / "config.json").exists()\n',
             [f"{HOSTILE_RUNS}::test_a_folder_that_only_looks_like_a_run_is_not_one"]),
    Mutation("config.json's fields used without checking their types", "src/gpulab/config.py",
             "            check_type(name, value, hints[name])\n", "            pass\n",
             [f"{HOSTILE_RUNS}::test_a_field_of_the_wrong_type_is_one_line"]),
    Mutation("config.json read whole, however large", "src/gpulab/train/rundir.py",
             'text = read_regular_file(self.path / "config.json", CONFIG_MAX_BYTES)',
             'text = read_regular_file(self.path / "config.json", 1 << 40)',
             [f"{HOSTILE_RUNS}::test_config_json_larger_than_any_config_is_not_read_whole"]),
    Mutation("an IDX file's data read whole, past its declared size (a gzip bomb decompressed in full)",
             "src/gpulab/data/idx.py", "data = _read_at_most(f, size + TRAILING_COUNTED + 1)", "data = f.read()",
             [HOSTILE_DATA]),
    Mutation("the declared IDX data size computed in int64: (2**31, 2**31, 4) overflows to 0", "src/gpulab/data/idx.py",
             "size = math.prod(shape)", "size = int(np.prod(shape, dtype=np.int64))", [HOSTILE_DATA]),
    Mutation("a file from elsewhere opened blocking: a FIFO with no writer hangs the open", "src/gpulab/io.py",
             "flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC", "flags = os.O_RDONLY | os.O_CLOEXEC",
             [f"{HOSTILE_DATA}::test_a_fifo_or_device_as_a_data_file"]),
    Mutation("cpu*K without an upper bound (cpu*65 builds 65 model copies)", "src/gpulab/devices.py",
             "    if k is None or not 1 <= k <= MAX_VIRTUAL_REPLICAS:", "    if k is None or not 1 <= k:",
             [HOSTILE_OPTIONS]),
    Mutation("cpu*K's count given to int() unguarded (5000 digits: a traceback)", "src/gpulab/devices.py",
             "    k = int(significant) if len(significant) <= len(str(MAX_VIRTUAL_REPLICAS)) else None",
             "    k = int(significant)", [HOSTILE_OPTIONS]),
    Mutation("an output the user edited after gpulab wrote it taken for gpulab's (its name in the record is enough)",
             "src/gpulab/io.py", "        elif _sha256_of(self.path / name) not in (recorded or {}).get(name, []):",
             "        elif name not in (recorded or {}):", [HOSTILE_OUTPUTS]),
    Mutation("a run's profile/ that is a link followed (train --profile writes into its target)", "src/gpulab/io.py",
             "            if self.real_folder:", "            if False:", [HOSTILE_OUTPUTS]),
    Mutation("export's model and numbers written one after the other (a failed OUT.json leaves a new OUT)",
             "src/gpulab/io.py", "        staged = _stage_all(self.path, files) if together else {}",
             "        staged, together = {}, False", [HOSTILE_OUTPUTS]),
    Mutation("gpulab's bytecode prefix set over an install that has its own bytecode (which it then hides)",
             "src/gpulab/bytecode.py", "if source is None or has_bytecode(source) or os.access(source.parent, os.W_OK):",
             "if source is None or os.access(source.parent, os.W_OK):", ["tests/test_bytecode.py"]),
    Mutation("a sharded checkpoint's pieces read wherever its metadata points (/dev/zero, ../, past a file's end)",
             "src/gpulab/parallel/shard_files.py", "    check_storage(folder, metadata)\n", "",
             [f"{HOSTILE_RUNS}::test_a_sharded_checkpoint_pointing_outside_its_files_is_refused"]),
    Mutation("the recorder's import hook consumed by a lookup (find_spec) that imports nothing: the recorder never starts",
             "src/gpulab/monitor/record/interpreter.py", "                sys.meta_path.insert(0, self)\n",
             "                pass\n", ["tests/monitor/test_import_hook.py"]),
    Mutation("decoded Fashion-MNIST found by its files' paths only (a file replaced: its old arrays read)",
             "src/gpulab/data/decoded.py", 'h.update(f"{key}={path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino};".encode())',
             'h.update(f"{key}={path};".encode())', ["tests/data/test_decoded.py"]),
    Mutation("a decoded entry believed without the checks its source files get",
             "src/gpulab/data/fashion_mnist.py", "    if arrays is None or splits_problem(paths, arrays):",
             "    if arrays is None:", ["tests/data/test_decoded.py"]),
    Mutation("curves.png drawn in the run's own thread before its last epoch (the epoch waits for it)",
             "src/gpulab/train/curves.py", 'self.drawing.start(lambda: draw(self.folder / "curves.png", rows, title))',
             'draw(self.folder / "curves.png", rows, title)', ["tests/train/test_rundir.py"]),
    Mutation("ReLUAvgPool2d's backward divides by k, not the window's k*k", "src/gpulab/models/layers.py",
             "F.interpolate(grad / (k * k),", "F.interpolate(grad / k,", ["tests/models/test_layers.py"]),
    Mutation("ReLUAvgPool2d's backward skips ReLU's mask", "src/gpulab/models/layers.py",
             "return torch.ops.aten.threshold_backward(spread, activation, 0), None", "return spread, None",
             ["tests/models/test_layers.py"]),
    Mutation("ReLUAvgPool2d's backward reads an NCHW gradient beside a channels_last activation",
             "src/gpulab/models/layers.py", "            grad = grad.contiguous(memory_format=torch.channels_last)\n",
             "            pass\n", ["tests/models/test_layers.py"]),
    Mutation("auto records the step of a model gpulab cannot vouch for", "src/gpulab/train/precision.py",
             "cfg.model in MODELS and not own_parts", "cfg.model in MODELS", ["tests/train/test_compile.py"]),
    Mutation("the recorder's own frames left for torch.compile to compile", "src/gpulab/monitor/record/patches.py",
             "        for code in _code_of(module):\n            _leave_uncompiled(code)\n",
             "        for code in _code_of(module):\n            pass\n", ["tests/monitor/test_compile_unchanged.py"]),
    Mutation("gpulab's wrappers left in place while torch.compile traces", "src/gpulab/monitor/record/patches.py",
             "        for owner, name, original, _ in _patched:\n            setattr(owner, name, original)",
             "        for owner, name, original, _ in _patched:\n            pass",
             ["tests/monitor/test_compile_unchanged.py"]),
    Mutation("a backward's compile counted as a compiled frame", "src/gpulab/monitor/analyze/compiled.py",
             '"compiles": len(by_trigger.get("dynamo", [])),', '"compiles": len(compiles),',
             ["tests/monitor/test_compile_probe.py::test_the_counts_are_torchs_a_backward_and_a_cuda_graph_recording_apart_from_the_frames"]),
    Mutation("an epoch's checkpoint written from the live tensors the next epoch changes", "src/gpulab/train/loop.py",
             "    saved, rows = detached(state), [dict(r) for r in history]",
             "    saved, rows = state, [dict(r) for r in history]",
             ["tests/train/test_train.py::test_the_next_epoch_trains_while_the_checkpoint_is_written_from_a_copy"]),
    Mutation("the next epoch waits for the checkpoint", "src/gpulab/train/loop.py",
             "    if last or run.world.world_size > 1:\n        raise_if(run_dir.writes.wait())",
             "    if True:\n        raise_if(run_dir.writes.wait())",
             ["tests/train/test_train.py::test_the_next_epoch_trains_while_the_checkpoint_is_written_from_a_copy"]),
    Mutation("a stack sample weighs gpulab's own work before it", "src/gpulab/monitor/record/probes/stacks.py",
             "seconds = (now - self._last_sample) - (own - self._own_at_last_sample)",
             "seconds = now - self._last_sample",
             ["tests/monitor/test_stacks.py::test_gpulab_s_own_work_between_steps_is_never_the_script_s_line"]),
    Mutation("a stack sample taken in gpulab's own work counted for the script's line",
             "src/gpulab/monitor/record/probes/stacks.py", "        if not under_way:\n            self._note(frame, seconds, seconds * blocked)",
             "        if True:\n            self._note(frame, seconds, seconds * blocked)",
             ["tests/monitor/test_stacks.py::test_gpulab_s_own_work_between_steps_is_never_the_script_s_line"]),
    Mutation("inductor's generated code taken for the user's", "src/gpulab/monitor/record/frames.py",
             "    roots.update(generated_code_dirs())\n", "",
             ["tests/monitor/test_stacks.py::test_code_torch_compile_generated_is_never_the_users_line"]),
    Mutation("a cost of every step placed at a line sampled in one step", "src/gpulab/monitor/analyze/findings.py",
             "if steps.get(where, 0) >= _steps_needed(rec)}", "if True}",
             ["tests/monitor/test_profile_cli.py::test_python_loop_between_steps_is_found_at_its_line"]),
    Mutation("a line's steps counted once for the whole run, not per step", "src/gpulab/monitor/record/probes/stacks.py",
             "        self._tally_held(keep=not outlier)\n", "",
             ["tests/monitor/test_stacks.py::test_each_line_counts_the_steps_its_samples_fell_in"]),
    Mutation("the samples of an outlier step (an evaluation) place the steady steps' costs",
             "src/gpulab/monitor/record/probes/stacks.py", "        self._tally_held(keep=not outlier)\n",
             "        self._tally_held(keep=True)\n",
             ["tests/monitor/test_stacks.py::test_the_samples_of_an_outlier_step_place_no_line"]),
    Mutation("a skipped CUDA graph's reason without the script's line that caused it", "src/gpulab/compiler.py",
             "        if not scripts:\n            return reason\n", "        if True:\n            return reason\n",
             ["tests/test_compiler.py::test_a_skipped_cuda_graph_names_the_scripts_line_that_wrote_into_an_input"]),
    Mutation("the command leaves without running the exit handlers", "src/gpulab/cli.py",
             "    atexit._run_exitfuncs()\n", "",
             ["tests/test_cli.py::test_the_command_leaves_after_its_exit_handlers_without_the_interpreters_teardown"]),
    Mutation("the command leaves while a thread Python would wait for runs", "src/gpulab/cli.py",
             "    if waited_for or (code != 0", "    if (code != 0",
             ["tests/test_cli.py::test_the_command_leaves_after_its_exit_handlers_without_the_interpreters_teardown"]),
    Mutation("a failing rank under torchrun leaves at once", "src/gpulab/cli.py",
             "    if waited_for or (code != 0 and os.environ.get(\"TORCHELASTIC_ERROR_FILE\")):\n",
             "    if waited_for:\n",
             ["tests/test_cli.py::test_the_command_leaves_after_its_exit_handlers_without_the_interpreters_teardown"]),
    Mutation("the measurement windows skipped between steps before they are done", "src/gpulab/monitor/record/windows.py",
             "        return not all(window.finished for window in self._windows)", "        return False",
             ["tests/monitor/test_memory.py::test_the_memory_split_matches_what_the_script_counts_itself"]),
    Mutation("the transform window taken as done while it waits for its turn", "src/gpulab/monitor/record/probes/transforms.py",
             '        return self._phase == "done"', '        return self._phase in ("waiting", "done")',
             ["tests/monitor/test_transform_cost.py::test_the_window_opens_after_warm_up_and_the_other_windows_only_if_there_are_transforms"]),
    Mutation("the script by hand anneals its learning rate from the wrong step", "src/gpulab/bench/by_hand.py",
             "    progress = (step - warmup) / max(1, total - warmup)", "    progress = step / max(1, total - warmup)",
             ["tests/bench/test_by_hand.py::test_it_trains_gpulab_train_s_default_recipe"]),
    Mutation("the script by hand standardises each split with its own statistics", "src/gpulab/bench/by_hand.py",
             "    return [(X.sub_(MEAN).div_(STD), y) for X, y in splits]",
             "    return [(X.sub_(X.mean()).div_(X.std()), y) for X, y in splits]",
             ["tests/bench/test_by_hand.py::test_its_data_is_gpulab_s"]),
    Mutation("the writer's heartbeat tick taken outside its lock: silence() does not wait for it", "src/gpulab/monitor/record/writer.py",
             "            with self._ticking:  # silence() waits for a tick under way: nothing is written after it returns\n"
             "                if self.on_tick is not None and not self.silenced:\n"
             "                    self.on_tick()\n",
             "            if self.on_tick is not None and not self.silenced:\n"
             "                self.on_tick()\n",
             ["tests/monitor/test_profile_jobs.py::test_a_silenced_writer_lets_its_tick_under_way_end_and_starts_no_other"]),
    Mutation("gpulab bench --rounds ignored", "src/gpulab/bench/__init__.py",
             "    return replace(cfg, rounds=rounds) if rounds is not None and repeats_rounds(module) else cfg",
             "    return cfg",
             ["tests/bench/test_bench_cli.py::test_rounds_sets_the_rounds_of_a_benchmark_that_runs_them"]),
]


def scratch_copy(into: Path) -> Path:
    """The checkout's source and tests, without the venv, git or run outputs."""
    ignore = shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", "*.egg-info", "bench-out", "profiles")
    for name in ("src", "tests", "pyproject.toml"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, into / name, **({"ignore": ignore} if source.is_dir() else {}))
    return into


def plant(copy: Path, m: Mutation) -> None:
    path = copy / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutation '{m.what}': the text to change is not in {m.file} exactly once; update this script")
    path.write_text(text.replace(m.old, m.new))


def run_tests(copy: Path, tests: list[str]) -> tuple[bool, str, float]:
    """(whether a test failed, the first failure or pytest's last line, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=copy,
                          env=env, capture_output=True, text=True)
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    said = (done.stdout.strip() or done.stderr.strip() or f"exit code {done.returncode}").splitlines()[-1]
    return done.returncode != 0, (failed[0] if failed else said), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--only", type=int, nargs="*", help="mutation numbers (1-based)")
    args = parser.parse_args()
    chosen = [(i, m) for i, m in enumerate(MUTATIONS, start=1) if not args.only or i in args.only]
    if args.list:
        for i, m in chosen:
            print(f"{i}. {m.what} ({m.file}; tests: {' '.join(m.tests)})")
        return 0
    survivors = 0
    with tempfile.TemporaryDirectory(prefix="gpulab-mutation-") as tmp:
        clean = scratch_copy(Path(tmp) / "clean")
        failed, line, _ = run_tests(clean, sorted({t for _, m in chosen for t in m.tests}))
        if failed:
            print(f"the unmutated tests fail ({line}): fix them first")
            return 2
        for i, m in chosen:
            copy = Path(tmp) / f"m{i}"
            shutil.copytree(clean, copy)
            plant(copy, m)
            caught, line, seconds = run_tests(copy, m.tests)
            survivors += not caught
            print(f"{i}. {m.what}: {'caught' if caught else 'NOT CAUGHT'} ({seconds:.0f} s) {line if caught else ''}".rstrip(),
                  flush=True)
            shutil.rmtree(copy)
    print(f"{len(chosen) - survivors} of {len(chosen)} mutations caught")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
