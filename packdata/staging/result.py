"""What one ``stage`` of a local pack did (:class:`StageResult`), and why shards were left behind, in words."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.host.memory import SafetyWarning
from packdata.staging.tmpfs import TmpfsArea
from packdata.units import format_size

__all__ = ["StageResult"]


@dataclass
class StageResult:
    """What one ``stage`` run did."""

    source: Path
    staged: Path
    area: Path
    copied: list[str]
    reused: list[str]
    left: list[str]
    bytes_copied: int
    bytes_staged: int
    bytes_left: int
    budget: int
    seconds: float
    free_after: int
    smallest_left: int = 0  # bytes of the smallest shard asked for and left behind (0: none)
    bound: str = "budget"  # what held the shards: 'budget' (given), 'tmpfs' (its free room), 'folder' (disk room)
    tmpfs: TmpfsArea | None = None
    warnings: list[SafetyWarning] = field(default_factory=list)

    @property
    def advice(self) -> str:
        """Why shards were left behind and what to do, in one line ('' when everything is staged)."""
        if not self.left:
            return ""
        if not self.smallest_left:  # every shard asked for was staged: the others were not asked for
            return "only the shards asked for (shards=LIST) are staged; name the others too to stage them"
        room = "" if self.bound == "budget" else f": what {self.area} has free"
        why = (
            f"the budget ({format_size(self.budget)}{room}) holds no more shards: the smallest left is "
            f"{format_size(self.smallest_left)}"
        )
        more = {
            "budget": "a bigger budget=SIZE",
            "tmpfs": "a bigger tmpfs (tmpfs=SIZE with resize=True)",
            "folder": f"more free space at {self.area} (or to=DIR on a bigger disk)",
        }[self.bound]
        return (
            f"{why}. Stage more with {more}, or convert with a smaller shard size (shards are the unit stage "
            "copies; `packdata convert --shard-size`)"
        )

    @property
    def mb_per_s(self) -> float:
        """Copy throughput of this run, in MB/s (10**6 bytes)."""
        return self.bytes_copied / 1e6 / max(self.seconds, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in ("source", "staged", "area"):
            data[key] = os.fspath(data[key])
        if self.tmpfs is not None:
            data["tmpfs"] = self.tmpfs.to_dict()
        data["mb_per_s"] = round(self.mb_per_s, 1)
        return data
