"""The cost model of the prefix cache's plans: measured rates of prefill (seconds per token)
and of loads from each lower tier (a fixed cost per load and bytes per second), from which
PrefixCache predicts whether loading a prefix beats recomputing it, and the scheduler how many
prefill tokens a step with decodes may take within its time target.

A load's time is `fixed + bytes / bandwidth`. The fixed part is what a load pays whatever its
size: index queries, opening and parsing blobs, handing reads to threads and waiting for them,
the pools' copy launches; on a CPU with a small model it is nearly all of it (about 1 ms, where
the bytes take 0.1 ms), on a slow or network disk it is each read's latency. Both parts are fitted
to every timed load by recursive least squares (a line through loads of different sizes), so a
fixed cost is not taken for a slow bandwidth, which would price a larger load too high and a
smaller one too low.
"""

from __future__ import annotations

DEVICE, HOST, DISK = "device", "host", "disk"  # the cache's tiers
PAGE_CACHE = "page cache"  # disk reads served from the page cache: a rate of their own, not a tier

FIRST_PREFILL_RANGE = 4.0  # how far the first timed prefill may move the guessed rate
LOAD_FORGET = 0.8  # the weight a load fit keeps on the loads before the latest (per load)
LOAD_NOISE = 0.1  # the relative error of one timed load
FIXED_SPREAD = 5e-3  # s: how far a machine's fixed cost per load may be from the guess
BYTES_SPREAD = 10.0  # how many times its byte time a load's may be off the guess
GUESSED_BANDWIDTH = {HOST: 5e9, DISK: 1e9, PAGE_CACHE: 3e9}  # bytes/s, until loads are timed
MIN_S_PER_BYTE = 1e-11  # s/byte: no tier loads faster than 100 GB/s


class CostModel:
    """Measured rates: prefill seconds per token and each lower tier's load cost (a fixed part
    and a bandwidth). Disk loads have two: from the page cache and from the disk itself; a load
    is priced by the fraction of its bytes in the page cache when the plan is made."""

    def __init__(self, prefill_s_per_token: float) -> None:
        self.prefill_s_per_token = prefill_s_per_token
        self.prefill_measured = False  # until a prefill is timed, the rate is a guess
        self.latest_s_per_token = 0.0  # the latest timed prefill's own rate, unsmoothed
        self.bandwidth = dict(GUESSED_BANDWIDTH)  # bytes/s, refined by every load
        # fixed seconds per load (its blobs are read concurrently), refined by every load
        self.latency = {HOST: 1e-4, DISK: 3e-4, PAGE_CACHE: 1e-4}
        self.fits: dict[str, tuple[float, float, float]] = {}  # rate -> its fit's covariance

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
        """Learn from one load of `nbytes` that took `seconds`, from the request's wait for it to
        its state in the pools. A disk load with `resident` of its bytes in the page cache
        teaches the page cache's costs when (nearly) all were cached, else the disk's: its time
        less what the cached part should have taken at the page cache's current costs."""
        if tier == DISK and resident >= 0.95:
            tier = PAGE_CACHE
        elif tier == DISK and resident > 0:
            seconds = (seconds - resident * self._rate_s(PAGE_CACHE, nbytes)) / (1 - resident)
        if nbytes > 0 and seconds > 0:
            self._fit(tier, nbytes, seconds)

    def _fit(self, rate: str, nbytes: int, seconds: float) -> None:
        """Move `rate`'s fixed cost and inverse bandwidth towards the line through its loads:
        one step of recursive least squares on relative errors (errors bounded by 1: relative to
        the larger of the measured and predicted times), forgetting old loads by
        LOAD_FORGET. Loads of one size alone leave the split between the two parts to the
        prior (FIXED_SPREAD of fixed cost against BYTES_SPREAD times the byte time): a small
        load's surprise goes to the fixed cost, a large one's to the bandwidth."""
        fixed, per_byte = self.latency[rate], 1 / self.bandwidth[rate]
        # the prior's spread, which also bounds the covariance (no wind-up over loads of one size)
        cap_f = (max(fixed, FIXED_SPREAD) / LOAD_NOISE) ** 2
        cap_b = (BYTES_SPREAD * max(per_byte, 1 / GUESSED_BANDWIDTH[rate]) / LOAD_NOISE) ** 2
        p_ff, p_fb, p_bb = self.fits.get(rate, (cap_f, 0.0, cap_b))
        # the load's regressors and error, relative to the larger of its time and the predicted
        # one: a load timed near zero (a disk load less a page-cache share estimated high)
        # weighs as one at the prediction, not as one measured to the nanosecond
        scale = max(seconds, fixed + per_byte * nbytes)
        x_f, x_b = 1 / scale, nbytes / scale
        error = (seconds - fixed - per_byte * nbytes) / scale
        g_f, g_b = p_ff * x_f + p_fb * x_b, p_fb * x_f + p_bb * x_b
        d = LOAD_FORGET + x_f * g_f + x_b * g_b
        k_f, k_b = g_f / d, g_b / d
        fixed, per_byte = fixed + k_f * error, per_byte + k_b * error
        p_ff, p_fb, p_bb = p_ff - k_f * g_f, p_fb - k_f * g_b, p_bb - k_b * g_b
        # a part past its bound is held there, and the other moves as the fit correlates them
        # (a slope gone negative, say, leaves the fixed cost explaining the load)
        if per_byte < MIN_S_PER_BYTE and p_bb > 0:
            fixed += p_fb / p_bb * (MIN_S_PER_BYTE - per_byte)
            per_byte = MIN_S_PER_BYTE
        if fixed < 0 and p_ff > 0:
            per_byte = max(per_byte - p_fb / p_ff * fixed, MIN_S_PER_BYTE)
        fixed = max(fixed, 0.0)
        p_ff = min(p_ff / LOAD_FORGET, cap_f)
        p_bb = min(p_bb / LOAD_FORGET, cap_b)
        bound = 0.999 * (p_ff * p_bb) ** 0.5
        p_fb = min(max(p_fb / LOAD_FORGET, -bound), bound)
        self.fits[rate] = (p_ff, p_fb, p_bb)
        self.latency[rate], self.bandwidth[rate] = fixed, 1 / per_byte

    def calibrate(self, tier: str, nbytes: int, seconds: float) -> None:
        """Take a rate measured on purpose (a timed read at start) in place of the guess."""
        if nbytes > 0 and seconds > 0:
            self.bandwidth[tier] = nbytes / seconds
            self.fits.pop(tier, None)

    def _rate_s(self, rate: str, nbytes: float) -> float:
        """Seconds for a load of `nbytes` at `rate` (a tier, or the page cache)."""
        return self.latency[rate] + nbytes / self.bandwidth[rate]

    def fixed_s(self, tier: str, resident: float = 0.0) -> float:
        """The fixed part of a load from `tier` (`resident`: the fraction of a disk load's bytes
        that the page cache holds): paid once per load, however many blobs it reads."""
        if tier == DEVICE:
            return 0.0
        if tier == DISK:
            return resident * self.latency[PAGE_CACHE] + (1 - resident) * self.latency[DISK]
        return self.latency[tier]

    def bytes_s(self, tier: str, nbytes: float, resident: float = 0.0) -> float:
        """The part of a load from `tier` that grows with its `nbytes` (`resident` as above)."""
        if tier == DEVICE:
            return 0.0
        if tier == DISK:
            per_byte = resident / self.bandwidth[PAGE_CACHE] + (1 - resident) / self.bandwidth[DISK]
            return nbytes * per_byte
        return nbytes / self.bandwidth[tier]

    def load_s(self, tier: str, nbytes: float, resident: float = 0.0) -> float:
        """Predicted seconds of one load of `nbytes` from `tier` (`resident` as above)."""
        return self.fixed_s(tier, resident) + self.bytes_s(tier, nbytes, resident)
