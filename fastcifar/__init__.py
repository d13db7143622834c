"""fastcifar: a fast, honest data-parallel CIFAR-10 trainer."""

__version__ = "0.1.0"
