"""Progress on stderr: a one-line bar for the training loop and plain log lines."""

import sys
import time


def log(message: str) -> None:
    """One line on stderr, flushed."""
    print(message, file=sys.stderr, flush=True)


def _fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """A one-line progress bar on stderr (a plain line per update when not a tty)."""

    def __init__(self, total: int, start: int = 0, stream=None, every: int = 10):
        self.total, self.start, self.every = total, start, max(every, 1)
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.losses: list[float] = []
        self.open = False  # a tty bar line not yet ended

    def update(self, step: int, loss: float, tokens: int, lr: float) -> None:
        self.tokens += tokens
        self.losses.append(loss)
        if step % self.every and step != self.total:
            return
        elapsed = time.perf_counter() - self.t0
        done = step - self.start
        tps = self.tokens / elapsed if elapsed > 0 else 0.0
        eta = elapsed / done * (self.total - step) if done else 0.0
        width = 24
        filled = int(width * step / self.total)
        bar = "#" * filled + "-" * (width - filled)
        mean = sum(self.losses) / len(self.losses)
        self.losses = []
        line = (
            f"[{bar}] step {step}/{self.total}  loss {mean:.4f}  lr {lr:.2e}  "
            f"{tps:,.0f} tok/s  {_fmt_time(elapsed)} < {_fmt_time(eta)}"
        )
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == self.total else ""))
            self.open = step != self.total
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End a bar line left open on a tty, so what follows (an error) starts a line."""
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False
