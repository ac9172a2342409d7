"""Is the job alive? Each recorded process says how far it got and, when asked, where it is
blocked; the parent watches for a job that stands still, and the report says how each process
ended. One child/parent pair and the files between them (protocol.py; each module's part:
docs/architecture.md).

Only child.py runs inside the job (it may import torch); the others read files and recordings.
"""
