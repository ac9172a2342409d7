"""The recording side of the profiler: everything here runs inside the user's processes and
writes events-<pid>.jsonl (docs/architecture.md). Only the orchestration imports it
(monitor/session.py; autostart through parent/runner.py's PYTHONPATH).
"""
