"""One asyncio event loop on a thread of its own, for a transport whose client library is asyncio's
(nats-py, aio-pika): the dispatcher's delivery threads run each send on it and wait for the result, so one
connection carries every thread's messages and many acknowledgements are awaited at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")

#: How long closing a transport waits for its connections to close.
CLOSE_TIMEOUT_S = 5.0


class LoopThread:
    """An event loop running on a daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], deadline: float) -> T:
        """Run ``coro`` on the loop and return its result; it is cancelled, and :class:`TimeoutError`
        raised, when ``deadline`` (local monotonic time) passes first."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            future.cancel()  # the coroutine is cancelled on the loop
            raise

    def close(self, last: Coroutine[Any, Any, None] | None = None) -> None:
        """Run ``last`` (closing connections; bounded by :data:`CLOSE_TIMEOUT_S`), then stop the loop."""
        if not self._thread.is_alive():
            if last is not None:
                last.close()
            return
        try:
            if last is not None:
                self.run(last, time.monotonic() + CLOSE_TIMEOUT_S)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(CLOSE_TIMEOUT_S)
            if not self._thread.is_alive():
                self.loop.close()
