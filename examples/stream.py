"""Stream DFlash output from Python.

    python examples/stream.py --model Qwen/Qwen3.5-9B --draft z-lab/Qwen3.5-9B-DFlash \
        --prompt "Write a haiku about unified memory."
"""

import argparse

from dflash_mlx import load, load_draft, stream_generate

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", required=True, help="target: hub repo id or local directory")
parser.add_argument("--draft", required=True, help="DFlash draft: hub repo id or local directory")
parser.add_argument("--prompt", default="Explain speculative decoding in one paragraph.")
parser.add_argument("--max-tokens", type=int, default=256)
args = parser.parse_args()

model, tokenizer = load(args.model)
draft = load_draft(args.draft)
messages = [{"role": "user", "content": args.prompt}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

accepted = []
for response in stream_generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens):
    print(response.text, end="", flush=True)
    accepted.append(response.accepted)
last = response
tau = sum(a + 1 for a in accepted[1:]) / max(len(accepted) - 1, 1)
print(
    f"\n\n{last.generation_tokens} tokens at {last.generation_tps:.1f} tok/s, "
    f"tau = {tau:.2f} tokens per cycle, peak memory {last.peak_memory:.2f} GB"
)
