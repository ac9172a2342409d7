"""The recording side of the profiler: everything here runs inside the user's processes (each
module, and how a record goes from a probe to events-<pid>.jsonl: docs/architecture.md).

Nothing outside this package imports it except the orchestration (monitor/session.py, and
autostart through parent/runner.py's PYTHONPATH); the analysis reads only what writer.py wrote.
The recorder's progress for the parent's hang watch is alive/child.py.
"""
