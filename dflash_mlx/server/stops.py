"""Stop strings over streamed text: found across token boundaries, never emitted."""

from typing import Optional


class StopMatcher:
    """Releases streamed text up to the first stop string.

    Text that could still be the start of a stop string is held back until
    the next segment shows whether it is one.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: Optional[str] = None  # the stop string that was reached

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        text = self.held + text
        found = {s: i for s in self.stops if (i := text.find(s)) >= 0}
        if found:
            self.held = ""
            self.matched = min(found, key=found.get)  # the earliest; the first listed of those
            return text[: found[self.matched]], True
        hold = max(
            (k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
             if text.endswith(s[:k])),
            default=0,
        )
        self.held = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """The held-back text, once the stream ended without a stop."""
        text, self.held = self.held, ""
        return text
