"""The parent side of `gpulab profile`: what runs in gpulab's own process, which never imports torch
(record/ is the side inside the job's processes; events.py is what passes between them; the hang
watch is alive/watch.py).

    runner.py      run the job with every Python process recorded, sample, read back, report
    job.py         the job's processes to a clean end: process group, subreaper, signals
    sampler.py     background sampling: NVML per GPU, psutil, the job's threads' CPU waits
    trial.py       `--try KEY=VALUE --steps K`: the first K steps as is and changed, compared
"""
