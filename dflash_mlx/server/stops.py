"""Stop strings over streamed text: found across token boundaries, never emitted."""


class StopMatcher:
    """Releases streamed text up to the first stop string.

    Text that could still be the start of a stop string is held back until
    the next segment shows whether it is one.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        text = self.held + text
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            return text[: min(found)], True
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
