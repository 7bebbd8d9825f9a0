"""Which browser pages may call the API server (CORS): `--allowed-origins` parsed, and a
request's Origin matched against it. api_http.py answers the preflights and marks the answers."""

from __future__ import annotations

import json

CORS_METHODS = "GET, HEAD, POST, OPTIONS"
# the default --allowed-origins: pages served from this machine, on any port (`:*`). vLLM's
# default is any origin; but a page of any site could then read this server's answers, and its
# `cached_tokens` would tell that page which prefixes the cache holds (the chats of `run` on
# the same cache dir among them)
LOCAL_ORIGINS = tuple(f"{scheme}://{host}:*" for host in ("localhost", "127.0.0.1", "[::1]")
                      for scheme in ("http", "https"))
CORS_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


def parse_allowed_origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: origins separated by commas (or a JSON list of them, vLLM's form),
    each `scheme://host[:port]`, `scheme://host:*` for any port, `null` (a page of a file), or
    "*" for any origin; "" for none. Lower-cased, as browsers send them. A value that is none
    of these raises ValueError naming it."""
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{text!r} is not a JSON list of origins")
    else:
        items = text.split(",")
    origins = tuple(i.strip().rstrip("/").lower() for i in items if i.strip())
    for origin in origins:
        scheme, sep, host = origin.partition("://")
        if origin not in ("*", "null") and not (sep and scheme.isalpha() and host
                                                 and "/" not in host):
            raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], "
                             "scheme://host:* for any port, null, or *)")
    return origins


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request's Origin is one of `allowed` (parse_allowed_origins'): the same
    origin, or one of a `scheme://host:*` entry's host with any port or none."""
    origin = origin.lower()
    for entry in allowed:
        if entry == "*" or entry == origin:
            return True
        if entry.endswith(":*"):
            base = entry[:-2]
            port = origin.removeprefix(base + ":") if origin.startswith(base + ":") else None
            if origin == base or (port is not None and port.isdigit()):
                return True
    return False
