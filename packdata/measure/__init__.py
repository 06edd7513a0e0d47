"""Measure: bench and tune, measuring DataLoaders the way users train.

The real loader and dataset classes, timed batch by batch after a warm-up,
memory sampled from every worker, the in-memory decode ceiling alongside. It
may import the reading side and the host facts; nothing below it imports it.
"""
