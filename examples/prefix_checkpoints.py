"""Prefill tokens two agents save when they share a system prompt (and tool descriptions) but not their user turns.

    python examples/prefix_checkpoints.py                 # the demo pair (4096-token context) and a synthetic 8k prompt
    python examples/prefix_checkpoints.py --interval 1024

The bundled demo pair's target is a hybrid (GatedDeltaNet) Qwen3.5: without
checkpoints, a prompt that parts from a stored one before its end reuses
nothing there. The server's app and engine run in this process (no socket):
agent A sends the system prompt and its task, then agent B the same system
prompt and another task, then agent C a prompt that parts from A's inside
the system prompt. Each reply's usage says how many prompt tokens came from
the prefix cache. The 8k rows run the demo target with its context raised to
16384 (a copy of its config; the weights are linked), which is enough to
count tokens, not to judge answers.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient

from dflash_mlx.demo import demo_pair
from dflash_mlx.server.app import Settings, create_app
from dflash_mlx.server.engine import Engine

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--interval", type=int, default=2048, help="a checkpoint every this many prompt tokens (0: none)")
parser.add_argument("--max-tokens", type=int, default=8)
args = parser.parse_args()


def system_prompt(lines: int) -> str:
    tools = [f"tool {i}: read_file(path) returns the text of the file at path number {i}." for i in range(lines)]
    return "You are a coding agent. You may call these tools:\n" + "\n".join(tools)


def long_context(pair, context: int) -> Path:
    """A copy of the target's folder whose config allows ``context`` positions (weights linked)."""
    folder = Path(tempfile.mkdtemp(prefix="dflash-mlx-long-"))
    for f in pair.target.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((pair.target / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = context
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run(name: str, target: str, draft: str, lines: int) -> None:
    engine = Engine(target, draft, prefix_cache_bytes=8 * 10**9, prefix_interval=args.interval)
    engine.start()
    system = system_prompt(lines)
    parted = system[: len(system) * 2 // 3] + "\nThe rest of the tools are gone."
    agents = [("A", system, "List the files in the current folder."),
              ("B", system, "Which tool reads a file? Answer in one line."),
              ("C", parted, "List the files in the current folder.")]
    with TestClient(create_app(engine, Settings("demo"))) as client:
        for agent, prompt, task in agents:
            start = time.perf_counter()
            reply = client.post("/v1/chat/completions", json={
                "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": task}],
                "max_tokens": args.max_tokens, "temperature": 0})
            seconds = time.perf_counter() - start
            reply.raise_for_status()
            usage = reply.json()["usage"]
            details = usage["prompt_tokens_details"]
            print(f"| {name} | {agent} | {usage['prompt_tokens']} | {details['cached_tokens']} "
                  f"| {details['cache_tier'] or '-'} | {seconds:.2f} |", flush=True)
        stats = client.get("/health").json()["prefix_cache"]
    engine.stop()
    print(f"<!-- {name}: {stats['entries']} entries, {stats['checkpoints']} checkpoints, "
          f"{stats['bytes'] / 1e6:.1f} MB; {stats['tokens_saved']} prompt tokens not prefilled -->")


pair = demo_pair()
print(f"checkpoint interval {args.interval}\n")
print("| prompt | agent | prompt tokens | cached | tier | seconds |")
print("|---|---|---:|---:|---|---:|")
run("demo 4k", str(pair.target), str(pair.draft), 150)
run("synthetic 8k", str(long_context(pair, 16384)), str(pair.draft), 330)
