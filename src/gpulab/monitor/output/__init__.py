"""What a profile writes and prints: report.json and the terminal report (report.py),
timeline.png (timeline.py), trace.json (trace.py)."""
