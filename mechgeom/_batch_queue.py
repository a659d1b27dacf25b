"""The Ray executor's queue of pending work items: items of one text batch stay with one actor slot, an idle
slot steals half of the largest batch left, and a dead actor's items go back to the front."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any


class BatchQueue:
    """Pending item indices grouped by batch; each actor slot owns a batch while it has items."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)
        groups: dict[Any, list[int]] = {}
        for i, item in enumerate(self.items):
            b = item.batch if isinstance(item.batch, Hashable) else repr(item.batch)
            groups.setdefault(("batch", b) if item.batch is not None else ("item", i), []).append(i)
        self.free: list[list[int]] = list(groups.values())
        self.owned: dict[int, list[int]] = {}

    def take(self, slot: int) -> tuple[int, Any] | None:
        group = self.owned.get(slot)
        if not group:
            if self.free:
                group = self.owned[slot] = self.free.pop(0)
            else:  # steal the second half of the largest owned batch
                donor = max(self.owned.values(), key=len, default=[])
                if len(donor) < 2:
                    return None
                half = len(donor) // 2
                group = self.owned[slot] = donor[half:]
                del donor[half:]
        i = group.pop(0)
        return i, self.items[i]

    def give_back(self, slot: int, items: list[int]) -> None:
        """The items a dead actor held, with its batch, back to the front of the queue for any actor."""
        group = sorted([*items, *self.owned.pop(slot, [])])
        self.free.insert(0, group)
