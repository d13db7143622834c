"""Layer 1: the plain-PyTorch reference ops the kernels implement and are tested against: batchnorm +
activation + pool (and with the conv before it), the training augmentation (and cutout on a float batch),
test-time augmentation. Every Triton kernel's ``*_reference`` lives here, none beside its kernel. Imports only core.
"""
