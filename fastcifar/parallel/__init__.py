"""Layer 4: several ranks: process groups and checks, the bucketed all-reduce, gradient compression,
local SGD. Imports core and ops.
"""
