"""The recording side of the profiler: everything here runs inside the user's processes.

    autostart/sitecustomize.py   every Python process of a profiled job: note it, wait for torch
    attach.py                    at the process's own `import torch`: start a Recorder, end it at exit
    recorder.py                  the Recorder: one process's recording, made of the parts below
      steps.py                   the span stack, time per category, step rules -> step records
      sites.py                   the user's lines that synced or copied
      stacks.py                  the hottest user line of each category (a sampling thread)
      transforms.py              per-sample transforms inside a DataLoader fetch
      ddp.py                     DistributedDataParallel's wait for its allreduce
      writer.py                  records -> events-<pid>.jsonl (monitor/events.py is the format)
      heartbeat.py               progress -> status-<pid>.json; where it is blocked, when asked
    patches.py                   the hooks and patches that call the recorder, installed as one set
    cuda.py, kernels.py          CUDA only: host syncs and copies; the torch.profiler kernel window
    frames.py, interpreter.py    the user's file:line; an import hook, signals in helper threads

Nothing outside this package imports it except the orchestration (monitor/session.py, and
autostart through runner.py's PYTHONPATH); the analysis reads only what writer.py wrote.
"""
