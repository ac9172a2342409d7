"""The analysis side of the profiler: reads events (monitor/events.py) and samples, never torch
or the recorder. diagnose.py is the front door."""
