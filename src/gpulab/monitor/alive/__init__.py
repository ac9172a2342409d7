"""Is the job alive? Each recorded process says how far it got and, when asked, where it is
blocked; the parent watches for a job that stands still, and the report says how each process
ended. One child/parent pair and the files between them:

    protocol.py   the files: status-<pid>.json, hang-request, hang-<pid>.json, tally-<pid>.bin
    child.py      in each recorded process (the recorder's helper thread): progress, the status
                  file, the durable step tally, the answer to the parent's question
    watch.py      in gpulab's own process, which never imports torch: the hang watch - a job
                  that stands still, where each rank is blocked, a hang or a stall
    hang.py       a hang in words: where each rank waits, what does not match, the fix
    stall.py      from the recording: one step far longer than the others, who stood still
    failure.py    from the recording: how each process ended, and which failed first

Only child.py runs inside the job (it may import torch); the others read files and recordings.
"""
