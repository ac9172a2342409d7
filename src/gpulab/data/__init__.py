"""Datasets and loaders: Fashion-MNIST from IDX files, batches resident on the device, and the
one rule (GlobalBatches) for which samples each step and each rank uses; a user's own data."""

from gpulab.data.fashion_mnist import CLASSES, Split, load
from gpulab.data.loader import DeviceLoader, HostLoader, ImageDataset
from gpulab.data.sampling import GlobalBatches
from gpulab.data.user import check_pairs, sample_shape, user_loader

__all__ = ["CLASSES", "DeviceLoader", "GlobalBatches", "HostLoader", "ImageDataset", "Split", "check_pairs", "load", "sample_shape", "user_loader"]
