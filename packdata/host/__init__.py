"""Host: facts about the machine and the rules derived from them.

It reads ``/proc`` and ``/sys`` (memory, cgroups, mounts, disks, CPUs, GPUs)
and derives memory safety, usable cores and a first worker count; it knows
nothing of packs, formats, datasets or torch, and imports nothing of packdata
but ``errors`` and ``units``.
"""
