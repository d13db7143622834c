"""Layer 5: one run's parts: the recipe (optimizer groups, schedule, per-run hooks), the captured step,
training state and resume, logs and summaries, progress, profiling, sparse training. Imports every
layer below.
"""
