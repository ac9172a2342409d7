"""Datasets and loaders: Fashion-MNIST from IDX files, and batches resident on the device."""

from gpulab.data.fashion_mnist import CLASSES, Split, load
from gpulab.data.loader import DeviceLoader, HostLoader, ImageDataset

__all__ = ["CLASSES", "DeviceLoader", "HostLoader", "ImageDataset", "Split", "load"]
