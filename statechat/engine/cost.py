"""The cost model of the prefix cache's plans: measured rates of prefill (seconds per token)
and of reads from each lower tier (bytes per second, and a latency per blob opened), from which
PrefixCache predicts whether loading a prefix beats recomputing it, and the scheduler how many
prefill tokens a step with decodes may take within its time target.
"""

from __future__ import annotations

DEVICE, HOST, DISK = "device", "host", "disk"  # the cache's tiers
PAGE_CACHE = "page cache"  # disk reads served from the page cache: a rate of their own, not a tier

FIRST_PREFILL_RANGE = 4.0  # how far the first timed prefill may move the guessed rate


class CostModel:
    """Measured rates: prefill seconds per token and each lower tier's read bandwidth. Disk
    reads have two: from the page cache and from the disk itself; a blob's bytes are priced by
    the fraction of it in the page cache when the plan is made."""

    def __init__(self, prefill_s_per_token: float) -> None:
        self.prefill_s_per_token = prefill_s_per_token
        self.prefill_measured = False  # until a prefill is timed, the rate is a guess
        self.latest_s_per_token = 0.0  # the latest timed prefill's own rate, unsmoothed
        self.bandwidth = {HOST: 5e9, DISK: 1e9, PAGE_CACHE: 3e9}  # bytes/s, refined by every load
        self.latency = {HOST: 0.0, DISK: 3e-4}  # per blob opened

    def observe_prefill(self, tokens: int, seconds: float, capped: bool = False) -> None:
        """Learn from a prefill run: the first one replaces the engine's guess (a rough FLOP
        count, 25-50% off on an H100) within a factor FIRST_PREFILL_RANGE of it (a first run
        that compiled kernels is no rate), later ones move the rate by 30%. A run of `capped`
        steps (chunks cut to a step time beside decodes) sets only the latest rate: its small
        chunks and decode rows cost more a token than a prompt computed alone, the rate
        the prefix cache prices a recompute at."""
        if tokens >= 64:
            rate = self.latest_s_per_token = seconds / tokens
            if capped:
                return
            if self.prefill_measured:
                rate = 0.7 * self.prefill_s_per_token + 0.3 * rate
            else:
                guess = self.prefill_s_per_token
                rate = min(max(rate, guess / FIRST_PREFILL_RANGE), guess * FIRST_PREFILL_RANGE)
            self.prefill_s_per_token, self.prefill_measured = rate, True

    def prefill_tokens_within(self, seconds: float) -> int:
        """How many tokens a prefill computes in `seconds`, at the slower of the learned rate
        and the latest timed prefill's own: a step that overran cuts the next one at once (the
        learned rate moves 30% a step, and its first value is held near the guess)."""
        rate = max(self.prefill_s_per_token, self.latest_s_per_token, 1e-12)
        return int(min(seconds / rate, 1 << 40))  # (an infinite target: no cap)

    def observe_load(self, tier: str, nbytes: int, seconds: float, resident: float = 0.0) -> None:
        """Learn from a load. A disk load with `resident` of its bytes in the page cache teaches
        the page cache's rate when (nearly) all were cached, else the disk's: its time less what
        the cached part should have taken at the current page-cache rate."""
        if tier == DISK and resident >= 0.95:
            tier = PAGE_CACHE
        elif tier == DISK:
            seconds -= resident * nbytes / self.bandwidth[PAGE_CACHE]
            nbytes = int((1 - resident) * nbytes)
        if nbytes >= 1 << 16 and seconds > 0:
            self.bandwidth[tier] = 0.5 * self.bandwidth[tier] + 0.5 * nbytes / seconds

    def calibrate(self, tier: str, nbytes: int, seconds: float) -> None:
        """Take a rate measured on purpose (a timed read at start) in place of the guess."""
        if nbytes > 0 and seconds > 0:
            self.bandwidth[tier] = nbytes / seconds

    def load_s(self, tier: str, nbytes: int, blobs: int = 1, resident: float = 0.0) -> float:
        """Predicted seconds to load `nbytes` in `blobs` blobs from `tier` (`resident`: the
        fraction of a disk load's bytes that the page cache holds)."""
        if tier == DEVICE:
            return 0.0
        if tier == DISK:
            per_byte = resident / self.bandwidth[PAGE_CACHE] + (1 - resident) / self.bandwidth[DISK]
            return nbytes * per_byte + blobs * self.latency[DISK]
        return nbytes / self.bandwidth[tier] + blobs * self.latency[tier]
