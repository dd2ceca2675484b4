"""Time to first token of one long prompt, cold and after a server restart (the prefix cache's disk tier).

    python examples/prefix_disk_ttft.py                     # the bundled demo pair
    python examples/prefix_disk_ttft.py --model M --draft D --words 20000

Starts ``dflash-mlx serve`` on a free port with an empty ``--prefix-cache-dir``,
sends the prompt (streamed, greedy) and times its first token, stops the
server, starts a new one on the same directory and sends the prompt again.
"""

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", help="target: hub repo id or local directory (default: the demo pair)")
parser.add_argument("--draft", help="DFlash draft (default: the registry's, or the demo pair's)")
parser.add_argument("--words", type=int, default=1500, help="words of filler text in the prompt (the demo pair reads 4096 tokens)")
parser.add_argument("--max-tokens", type=int, default=16)
args = parser.parse_args()

PROMPT = " ".join(f"line {i}: the agent's tools and history so far." for i in range(args.words // 8))
PROMPT += "\nSummarise the lines above in one sentence."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(directory: str):
    port = free_port()
    pair = [flag for name, value in (("--model", args.model), ("--draft", args.draft)) if value
            for flag in (name, value)]
    proc = subprocess.Popen([sys.executable, "-m", "dflash_mlx", "serve", "--port", str(port), *pair,
                             "--prefix-cache-dir", directory], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                sys.exit("the server exited; run `dflash-mlx serve` with these options to see why")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait()


def first_token(url: str) -> tuple[float, int, int, str]:
    """(seconds to the first text, prompt tokens, cached tokens, the text)."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as reply:
        if reply.status_code != 200:
            sys.exit(f"the server answered {reply.status_code}: {reply.read().decode()}")
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            for choice in chunk.get("choices", []):
                delta = choice["delta"].get("content") or choice["delta"].get("reasoning_content") or ""
                if delta and first is None:
                    first = time.perf_counter() - start
                text += delta
            usage = chunk.get("usage") or usage
            if "error" in chunk:
                sys.exit(f"the server failed: {chunk['error']}")
    return first, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], text


with tempfile.TemporaryDirectory(prefix="dflash-mlx-prefix-disk-") as directory:
    with server(directory) as url:
        cold = first_token(url)
    with server(directory) as url:
        warm = first_token(url)
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs)
print(f"prompt: {cold[1]} tokens; disk tier: {stored / 1e6:.1f} MB")
print(f"cold:          time to first token {cold[0]:.2f} s (cached {cold[2]})")
print(f"after restart: time to first token {warm[0]:.2f} s (cached {warm[2]})  {cold[0] / warm[0]:.1f}x")
print("same reply:", cold[3] == warm[3])
