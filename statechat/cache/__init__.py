"""Prefix-indexed state cache: chained block hashes, and (later) the host and disk tiers."""
