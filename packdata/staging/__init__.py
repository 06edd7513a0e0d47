"""Copying packs onto fast local storage (NVMe, tmpfs) and checking that the host can hold
them: stage, unstage, status, the staged marker, doctor. Asks the format registry which
files a shard is.
"""
