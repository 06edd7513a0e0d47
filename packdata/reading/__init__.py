"""Reading packs in training: torch datasets (one shared base), samplers, rank/world
splits, decoding, transforms, collate and loader helpers. Reads shards through the
format registry; never walks source folders.
"""
