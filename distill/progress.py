"""Progress lines for long data jobs (regeneration, feature capture): done / total, tokens/s and an ETA.

Log lines rather than a redrawn bar: a job's output usually goes to a Slurm or torchrun log file, where a bar's
carriage returns turn into one long line. At most one line every ``every_s`` seconds, and always the last one.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def format_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    def __init__(self, what: str, total: int, unit: str, every_s: float = 10.0, clock=time.perf_counter):
        self.what, self.total, self.unit, self.every_s, self.clock = what, total, unit, every_s, clock
        self.done, self.tokens = 0, 0
        self.started = self.last_line = clock()

    def line(self) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = self.done / elapsed
        eta = format_eta((self.total - self.done) / rate) if rate > 0 else "?"
        return (f"{self.what}: {self.done}/{self.total} {self.unit} ({100.0 * self.done / max(self.total, 1):.1f}%), "
                f"{self.tokens / elapsed:,.0f} tokens/s, ETA {eta}")

    def update(self, items: int, tokens: int) -> None:
        self.done += items
        self.tokens += tokens
        now = self.clock()
        if now - self.last_line >= self.every_s or self.done >= self.total:
            self.last_line = now
            log.info(self.line())
