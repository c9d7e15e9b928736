"""A live progress line for prefetch: bytes, files, rate, ETA (a plain line every few seconds off a tty)."""

from __future__ import annotations

import sys
import time

from cachefs.base.values import human_bytes
from cachefs.jobs import Progress

__all__ = ["ProgressPrinter"]


def _duration(s: float | None) -> str:
    if s is None:
        return "--:--"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class ProgressPrinter:
    def __init__(self, stream=None, quiet: bool = False) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.quiet = quiet
        self._last = 0.0
        self._printed = ""  # the last line printed

    def line(self, p: Progress) -> str:
        pct = 100.0 * p.bytes_done / p.bytes_total if p.bytes_total else 100.0
        width = 24
        fill = int(width * pct / 100)
        bar = "#" * fill + "-" * (width - fill)
        return (f"[{bar}] {pct:5.1f}%  {human_bytes(p.bytes_done)}/{human_bytes(p.bytes_total)}  "
                f"{p.files_done}/{p.files_total} files  {human_bytes(p.rate)}/s  ETA {_duration(p.eta)}")

    def __call__(self, p: Progress) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        interval = 0.2 if self.tty else 5.0
        if now - self._last < interval:
            return
        self._last = now
        self._print(self.line(p))

    def _print(self, line: str) -> None:
        if line == self._printed:
            return
        self._printed = line
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, p: Progress) -> None:
        """The final line, once (not again if the last one printed was it already)."""
        if self.quiet:
            return
        self._print(self.line(p))
        if self.tty:
            self.stream.write("\n")
