"""What ``dflash-mlx generate`` shows: the text on stdout, plain or with each
token styled by its origin (an accepted draft, or the target's own token), and
the run's figures in words on stderr."""

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from rich.console import COLOR_SYSTEMS, Console
from rich.style import Style

from .errors import DFlashError
from .generate import GenerationResponse
from .server.stops import StopMatcher

STYLES = {  # by whether the text came from drafts the target accepted
    True: Style(color="green"),
    False: Style(),  # the target's own tokens (the first one, each cycle's correction or bonus): unstyled
}
LEGEND = ("--show-drafts: green text was drafted and accepted by the target; "
          "uncolored text is the target's own token of each cycle")


def styled_console(no_color: bool) -> Optional[Console]:
    """A console on stdout that can show colors, or None: stdout is not a
    terminal, ``no_color`` is set, or the environment asks for none (NO_COLOR,
    TERM=dumb). FORCE_COLOR makes any stdout count as a terminal (rich's rule)."""
    console = Console(no_color=no_color or None, highlight=False)
    if console.is_terminal and console.color_system is not None and not console.no_color:
        return console
    return None


class Output:
    """Streams the responses' text to stdout up to the first stop string.

    Plain, the text is ``GenerationResponse.text`` as is. Styled (``console``
    given), each response's tokens are detokenized in two runs, its drafted
    tokens and then the target's, so each run's text keeps its origin; a
    character that needs tokens of both (the bytes of one UTF-8 character, a
    space the detokenizer holds for the next token) takes the origin of the
    token that completes it. A stdout that takes no more (ENOSPC, EPIPE) is a
    DFlashError.
    """

    def __init__(self, stops: list[str], console: Optional[Console] = None, detokenizer=None):
        self.matcher = StopMatcher(stops)
        self.console = console
        self.detokenizer = detokenizer
        self.pending: list[tuple[str, bool]] = []  # styled: (text, drafted) fed to the matcher, not yet shown

    def write(self, r: GenerationResponse) -> bool:
        """Show what of ``r`` is safe to show; True once a stop string is reached."""
        if self.console is None:
            shown, stopped = self.matcher.feed(r.text)
            self._write(shown)
            return stopped
        pieces = origin_pieces(self.detokenizer, r)
        self.pending += pieces
        shown, stopped = self.matcher.feed("".join(text for text, _ in pieces))
        self._show(len(shown))
        return stopped

    def close(self, stopped: bool) -> None:
        """The text held back for a stop string that never came (unless one
        did), and the final newline."""
        held = "" if stopped else self.matcher.flush()
        if self.console is None:
            self._write(held + "\n")
        else:
            self._show(len(held))
            self._write("\n")

    def _show(self, n: int) -> None:
        """Write the next ``n`` characters of the pending pieces, each styled by its origin."""
        out, colors = [], COLOR_SYSTEMS[self.console.color_system]
        while n > 0:
            text, drafted = self.pending.pop(0)
            if len(text) > n:
                self.pending.insert(0, (text[n:], drafted))
                text = text[:n]
            n -= len(text)
            out.append(STYLES[drafted].render(text, color_system=colors))
        self._write("".join(out))

    def _write(self, text: str) -> None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError as e:
            _discard_stdout()
            raise DFlashError(f"cannot write the output to stdout: {e.strerror or e}") from None


def _discard_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's own
    flush at exit does not fail a second time (with a traceback)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # a captured stdout has no descriptor, and no exit-time flush to fail
        pass
    finally:
        os.close(devnull)


def origin_pieces(detokenizer, r: GenerationResponse) -> list[tuple[str, bool]]:
    """``r``'s text as (text, drafted) pieces: its accepted drafts' text, then
    its target token's, through ``detokenizer`` (fed every token of the run)."""
    pieces = []
    for tokens, drafted in ((r.tokens[: r.drafted], True), (r.tokens[r.drafted :], False)):
        for token in tokens:
            detokenizer.add_token(token)
        if not drafted and r.finish_reason:
            detokenizer.finalize()
        text = detokenizer.last_segment
        if text:
            pieces.append((text, drafted))
    return pieces


@dataclass
class Tally:
    """A run's cycles, gathered from its responses (the prefill's is not a cycle)."""

    plain: int = 0  # cycles that were one target step, nothing drafted (b = 1)
    blocks: dict[int, int] = field(default_factory=dict)  # drafting cycles per block size
    accepted: int = 0  # drafted tokens the target accepted
    drafted: int = 0  # drafted tokens verified: b - 1 per chain cycle, the budget per tree cycle
    last: Optional[GenerationResponse] = None

    def add(self, r: GenerationResponse, tree_budget: Optional[int] = None) -> None:
        if self.last is not None:
            if r.block_size == 1:
                self.plain += 1
            else:
                self.blocks[r.block_size] = self.blocks.get(r.block_size, 0) + 1
                self.drafted += tree_budget or r.block_size - 1
                self.accepted += r.accepted
        self.last = r

    def summary(self, block_size, tree_budget: Optional[int], stopped: bool) -> str:
        """The stats line: speeds, then what the cycles did, in words."""
        last = self.last
        head = (f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
                f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s | ")
        tail = f" | peak memory {last.peak_memory:.2f} GB" + (" | stopped at a --stop string" if stopped else "")
        drafting = sum(self.blocks.values())
        cycles = drafting + self.plain
        if not cycles:
            return head + "no cycles: the prefill's token only" + tail
        tau = (self.accepted + cycles) / cycles
        shape = block_summary(block_size, self.blocks)
        if tree_budget:
            shape = f"tree of {tree_budget}, {block_summary(last.block_size, self.blocks)}"
        line = f"{cycles} cycles, tau {tau:.2f} tokens/cycle"
        if not self.plain:
            line += f", every one drafted ({shape})"
        elif not drafting:
            line += ", every one a plain target step (b = 1, no draft)"
        else:
            each = (self.accepted + drafting) / drafting
            line += (f": {drafting} drafted ({shape}) and made {each:.2f} tokens each, "
                     f"{self.plain} were plain target steps (b = 1, no draft)")
        if self.drafted:
            kind = "tree nodes" if tree_budget else "tokens"
            line += (f" | accepted {self.accepted} of {self.drafted} drafted {kind} "
                     f"({self.accepted / self.drafted:.1%})")
        return head + line + tail


def block_summary(block_size, blocks: dict[int, int]) -> str:
    """``block 16`` for a fixed block; ``block auto: 16x40 8x3`` (block x
    cycles, most used first) for the adaptive one."""
    if block_size != "auto":
        return f"block {block_size}"
    counts = sorted(blocks.items(), key=lambda kv: (-kv[1], -kv[0]))
    return "block auto: " + " ".join(f"{b}x{n}" for b, n in counts)
