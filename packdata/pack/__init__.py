"""What a pack is on disk, whatever its format: the manifest, the sample index (keys,
labels, sizes) and the record codec. Knows bytes and JSON; knows no storage format, no
torch, no folders.
"""
