"""Data parallelism: replicate, split, allreduce, synchronized update, in one process on k devices."""

from gpulab.parallel.allreduce import ALGORITHMS, Buckets, allreduce
from gpulab.parallel.data_parallel import DataParallel, Meter, replicate, split_batch

__all__ = ["ALGORITHMS", "Buckets", "DataParallel", "Meter", "allreduce", "replicate", "split_batch"]
