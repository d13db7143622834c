"""Layer 0: the settings (Config, presets, choices), the errors bad input raises, signals, atomic
files. Imports nothing of fastcifar.
"""
