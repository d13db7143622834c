"""Layer 3: the networks (ResNet-9, FastNet, AlexNet), their blocks, the choice of normalize block
(plain or Triton), torch.compile, and model files. Imports core, ops, kernels.
"""
