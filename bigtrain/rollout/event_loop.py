"""One asyncio event loop per process, on a daemon thread, for what users write as `async def` (reward
functions): as TRL 1.16's GRPOTrainer runs them (`start_event_loop_in_daemon`), the loop outlives each call, so a
client a function keeps between calls (an HTTP session bound to its loop) still works at the next step.

    results = settle_all([f(...), g(...)])   # awaited together; each a value, or the exception it raised
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def settle_all(awaitables: list[Awaitable]) -> list[Any]:
    """Run `awaitables` concurrently on the process's loop and wait for all: each one's value, or the exception
    it raised (any, SystemExit too, which would otherwise stop the loop for good)."""
    async def together() -> list[Any]:
        return list(await asyncio.gather(*(_settled(a) for a in awaitables)))
    return asyncio.run_coroutine_threadsafe(together(), _running_loop()).result()


async def _settled(awaitable: Awaitable) -> Any:
    try:
        return await awaitable
    except BaseException as e:  # noqa: BLE001 -- the user's code: handed back to the caller, who names it
        return e


def _running_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="bigtrain-async", daemon=True).start()
    return _loop
