"""Layer 1: the plain-PyTorch reference ops the kernels implement and are tested against: batchnorm +
activation + pool, the training augmentation, test-time augmentation. Imports only core.
"""
