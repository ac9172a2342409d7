"""What torch's flight recorder (TORCH_FR_BUFFER_SIZE, set by `gpulab profile` for its hang
watch) costs per collective: 2 ranks (gloo, loopback) time N small all_reduces with it off and
on, alternating, several rounds; the median per-call time of each and the difference.

usage: flock /tmp/gpulab-cpu.lock python benchmarks/flight_recorder_overhead.py [--calls 3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RANK_SCRIPT = """
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.zeros(256)
for _ in range(200):
    dist.all_reduce(x)
dist.barrier()
t = time.perf_counter()
for _ in range(int(sys.argv[1])):
    dist.all_reduce(x)
per_call = (time.perf_counter() - t) / int(sys.argv[1])
if dist.get_rank() == 0:
    print(per_call)
dist.destroy_process_group()
"""


def one_run(script: Path, calls: int, buffer: int) -> float:
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": str(buffer), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(calls)], env=env, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ranks.py"
        script.write_text(RANK_SCRIPT)
        times = {0: [], 2000: []}
        for r in range(args.rounds):
            for buffer in (0, 2000) if r % 2 == 0 else (2000, 0):
                times[buffer].append(one_run(script, args.calls, buffer))
    off, on = statistics.median(times[0]), statistics.median(times[2000])
    print(f"all_reduce of 256 floats, 2 ranks, gloo, {args.calls} calls x {args.rounds} rounds (alternating)")
    for buffer, label in ((0, "off (TORCH_FR_BUFFER_SIZE=0)"), (2000, "on  (TORCH_FR_BUFFER_SIZE=2000)")):
        us = [t * 1e6 for t in times[buffer]]
        print(f"  {label}: median {statistics.median(us):.1f} us/call  [{min(us):.1f} .. {max(us):.1f}]")
    print(f"  flight recorder adds {(on - off) * 1e6:+.1f} us per collective ({(on / off - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
