"""Conversion engines: where the reads and shard writes of a conversion run.

- ``local`` (in :mod:`packdata.convert`): reader threads in this process and one
  writer that rolls shards as it goes; resumable from its last commit.
- ``ray`` (:mod:`packdata.engines.ray`): the sorted file list is cut into shard
  tasks up front, each Ray task reads its files and writes one shard, and this
  process gathers the results into the manifest. Needs ``packdata[ray]``.

Both give the same samples, keys, labels and order for the same options, and
both publish the pack the same way: manifest last, then one rename.
"""

from __future__ import annotations

from packdata.errors import PackdataError

__all__ = ["ENGINES", "EngineError"]

ENGINES = ("local", "ray")


class EngineError(PackdataError):
    """A conversion engine is unavailable, or one of its tasks failed for good (after retries)."""
