"""Triton kernels for fastcifar: one file per fused op (kernel, launcher, autograd.Function, module, reference)."""
