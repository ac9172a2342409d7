"""gpulab: put every device to work in deep-learning training, and see where the time goes."""

__version__ = "0.1.0"
