"""The recording side of the profiler: everything here runs inside the user's processes.

    autostart/sitecustomize.py   every Python process of a profiled job: note it, wait for torch
    attach.py                    hook the process's own `import torch`; watch gpulab itself
    lifetime.py                  at that import: start a Recorder, end it at exit
    recorder.py                  the Recorder: the list of probes plus the sink; start, stop, forked lanes
    probes/                      one probe per recorded concern (probes/__init__.py lists them)
    probe.py                     what a probe is: install, remove, its lane, its snapshots
    sink.py                      what a probe writes through: spans, counts, records, step rules
    notices.py                   what probes tell one another (a module called, a batch fetched, ...)
    patches.py                   a probe's patches and hooks, undone as one set
    windows.py                   the measurement windows (kernels, memory, transforms) take turns
    steps.py                     the span stack, time per category, step rules -> step records
    writer.py, blocks.py         records -> events-<pid>.jsonl (monitor/events.py is the format)
    frames.py, interpreter.py    the user's file:line; an import hook, signals in helper threads

Nothing outside this package imports it except the orchestration (monitor/session.py, and
autostart through parent/runner.py's PYTHONPATH); the analysis reads only what writer.py wrote.
The recorder's progress for the parent's hang watch is alive/child.py.
"""
