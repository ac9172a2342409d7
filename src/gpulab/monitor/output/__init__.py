"""What a profile writes and prints: report.json and the terminal report (report.py),
timeline.png (timeline.py), trace.json (trace.py)."""

OUTPUTS = ("report.json", "timeline.png", "trace.json")
"""The files a profile writes into its folder (here, light to import: the parent checks them
before the job runs, long before it needs report.py's matplotlib)."""
