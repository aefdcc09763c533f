"""ServerOptions: the network-facing limits of `moekv serve` (kept free of heavy imports: the CLI
reads its defaults for --help)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

API_KEY_ENV = "MOEKV_API_KEY"
OPEN_PATHS = ("/health",)  # never behind the key (load balancers probe it)


@dataclass
class ServerOptions:
    """Network-facing limits of `moekv serve` (the flags of the same names)."""

    api_key: str | None = None  # None: open server
    metrics_require_key: bool = False
    max_request_bytes: int = 16 * 2**20
    read_timeout: float = 30.0  # seconds for the request headers, then for the body
    timeout_keep_alive: float = 5.0  # an idle keep-alive connection is closed after this
    limit_concurrency: int | None = 2048  # open connections; beyond: 503
    shutdown_timeout: float = 20.0  # SIGTERM: drain for this long, then close every connection

    def __post_init__(self) -> None:
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string (or None for an open server)")
        if self.api_key is not None and not self.api_key.isascii():
            raise ValueError("api_key must be ASCII (it travels in an HTTP header)")
        for name in ("max_request_bytes", "limit_concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("read_timeout", "timeout_keep_alive", "shutdown_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a number of seconds > 0")

    @classmethod
    def with_env_key(cls, api_key: str | None = None, **kwargs) -> "ServerOptions":
        """api_key, else the MOEKV_API_KEY environment variable, else none."""
        return cls(api_key=api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None, **kwargs)
