"""The discrete-event kernel. It knows nothing of GPUs, networks or traces.

A heap of ``(t_ns, priority, seq, handler, arg)``; ``seq`` is this engine's own counter, so equal
times and priorities run in the order they were scheduled (SimPy's core does the same). A handler
is called as ``handler(t_ns, arg)`` and returns the events it wants scheduled, as
``(t_ns, priority, handler, arg)`` tuples, or None. Only the loop touches the queue and the clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

Handler = Callable[[int, Any], "Iterable[Event] | None"]
Event = tuple[int, int, Handler, Any]


class Engine:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Handler, Any]] = []
        self._seq = 0
        self.now_ns = 0
        self.events_processed = 0

    def schedule(self, t_ns: int, priority: int, handler: Handler, arg: Any) -> None:
        if t_ns < self.now_ns:
            raise ValueError(f"event at {t_ns} ns scheduled in the past (now {self.now_ns} ns)")
        self._seq += 1
        heapq.heappush(self._heap, (t_ns, priority, self._seq, handler, arg))

    def run(self) -> int:
        """Process events until none is left; returns the time of the last one."""
        heap, push, pop = self._heap, heapq.heappush, heapq.heappop
        count = 0
        while heap:
            t, _, _, handler, arg = pop(heap)
            self.now_ns = t
            count += 1
            out = handler(t, arg)
            if out:
                for ev in out:
                    if ev[0] < t:
                        raise ValueError(f"handler {handler!r} scheduled {ev[0]} ns < now {t} ns")
                    self._seq += 1
                    push(heap, (ev[0], ev[1], self._seq, ev[2], ev[3]))
        self.events_processed += count
        return self.now_ns
