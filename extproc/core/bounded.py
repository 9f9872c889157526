"""Awaiting with a time bound."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """``asyncio.wait_for`` that keeps a cancel: on Python 3.11 a wait_for whose call completes as its task is
    cancelled returns the call's result and the cancel is lost, so a loop cancelled mid-write (the shared state's
    flusher, at a brain's shutdown) ran on and whatever awaited its end waited for ever. Raises TimeoutError."""
    async with asyncio.timeout(timeout_s):
        return await aw
