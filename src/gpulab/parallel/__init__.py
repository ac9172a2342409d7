"""Data parallelism: the strategies a training step runs through (gpulab.parallel.strategy).

    DataParallel   one process, k devices: replicate, split, allreduce, synchronized update
    Distributed    one device per torchrun rank: bucketed sync overlapped with backward
    DDPSync        one device per torchrun rank: PyTorch's DDP, the reference
    Sharded        one device per torchrun rank, the model sharded over them (FSDP2)
    World          this process's place in the job (rank, main process, agreeing on errors)
"""

from gpulab.parallel.allreduce import ALGORITHMS, Buckets, allreduce
from gpulab.parallel.data_parallel import DataParallel, replicate, split_batch
from gpulab.parallel.world import World

__all__ = ["ALGORITHMS", "Buckets", "DataParallel", "World", "allreduce", "replicate", "split_batch"]
