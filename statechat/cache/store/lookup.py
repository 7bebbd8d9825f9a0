"""Lookup: what the host and disk tiers hold of a prefix (StateStore.where), and the share of
each disk blob that the page cache holds, asked of the OS only when a plan needs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from statechat.cache.blobs.residency import resident_fraction

RESIDENT_BLOBS = 16  # blobs of a plan's prefix whose page-cache share is asked (Lookup)


@dataclass
class Lookup:
    """What the lower tiers hold of a prefix (StateStore.where): the tier of each block and
    checkpoint, and for those on disk their blob, whose page-cache share `cached` asks of the
    OS once, when a plan first needs it."""

    blocks: dict[str, str]
    ckpts: dict[str, str]
    block_blobs: dict[str, str] = field(default_factory=dict)
    ckpt_blobs: dict[str, str] = field(default_factory=dict)
    blob_dir: Path = Path()
    resident: dict[str, float] = field(default_factory=dict)  # blob -> fraction, once asked
    sampled: dict[str, float] = field(default_factory=dict)  # kind -> mean of the asked blobs
    spread: dict[str, float] = field(default_factory=dict)  # kind -> max - min of those

    def cached(self, kind: str, h: str) -> float:
        """The fraction of the blob of a disk block ("kv") or checkpoint ("ckpt") that is in the
        page cache; 0.0 for what is not on disk. After `sample_residency`, a blob it did not
        ask about gets the mean of those it asked about of its kind."""
        blob = (self.block_blobs if kind == "kv" else self.ckpt_blobs).get(h)
        if blob is None:
            return 0.0
        if blob not in self.resident:
            if kind in self.sampled:
                return self.sampled[kind]
            self.resident[blob] = resident_fraction(self.blob_dir / blob)
        return self.resident[blob]

    def ask(self, kind: str, h: str) -> None:
        """Ask the OS now about the blob of `h` (if on disk), rather than estimate its share."""
        blob = (self.block_blobs if kind == "kv" else self.ckpt_blobs).get(h)
        if blob is not None and blob not in self.resident:
            self.resident[blob] = resident_fraction(self.blob_dir / blob)

    def known(self, kind: str, hashes: list[str]) -> bool:
        """Whether `cached` gives the page-cache share of every blob of `hashes` as asked, or
        estimated from a sample whose blobs agreed (within 5%)."""
        if self.spread.get(kind, 0.0) <= 0.05:
            return True
        blobs_of = self.block_blobs if kind == "kv" else self.ckpt_blobs
        return all(blobs_of[h] in self.resident for h in hashes if h in blobs_of)

    def sample_residency(self, hashes: list[str]) -> None:
        """Ask the OS about at most RESIDENT_BLOBS of the disk blobs of the prefix `hashes`,
        half of them segments and half checkpoints, each evenly spaced along the prefix from
        its first to its deepest (a 32k prefix has some 64 blobs, and each question costs tens
        of microseconds)."""
        for kind, blobs_of in (("kv", self.block_blobs), ("ckpt", self.ckpt_blobs)):
            ordered = list(dict.fromkeys(blobs_of[h] for h in hashes if h in blobs_of))
            quota = RESIDENT_BLOBS // 2
            if len(ordered) > quota:
                ordered = [ordered[round(i * (len(ordered) - 1) / (quota - 1))]
                           for i in range(quota)]
            for blob in ordered:
                if blob not in self.resident:
                    self.resident[blob] = resident_fraction(self.blob_dir / blob)
            if ordered:
                shares = [self.resident[b] for b in ordered]
                self.sampled[kind] = sum(shares) / len(shares)
                self.spread[kind] = max(shares) - min(shares)
