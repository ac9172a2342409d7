"""Data parallelism: the strategies the training loop runs its steps through.

    DataParallel   one process, k devices: replicate, split, allreduce, synchronized update
    Distributed    one device per torchrun rank: bucketed sync overlapped with backward, or DDP
    World          this process's place in the job (rank, main process, agreeing on errors)
"""

from gpulab.parallel.allreduce import ALGORITHMS, Buckets, allreduce
from gpulab.parallel.data_parallel import DataParallel, replicate, split_batch
from gpulab.parallel.meter import Meter
from gpulab.parallel.world import World

__all__ = ["ALGORITHMS", "Buckets", "DataParallel", "Meter", "World", "allreduce", "replicate", "split_batch"]
