"""Turning sources into packs: the source walk, reading and validating files, the plan,
checkpoints and publishing, and the engines that run it (local threads, Ray). Writes
through the format registry; knows no torch.
"""
