"""How the commands run their asyncio work: on uvloop where it is installed."""

from __future__ import annotations

import asyncio


def run_async(coro) -> None:
    """Run `coro` on uvloop where it is installed, until it ends or Ctrl-C."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # uvloop is optional off Linux/macOS
        pass
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass
