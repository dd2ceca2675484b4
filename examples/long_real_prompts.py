"""Long prompts of real, varied text for ``bench --prompts``: whole standard-library
modules that neither model of the demo pair was trained on, concatenated.

    python examples/long_real_prompts.py --out real_long.jsonl
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        dflash-mlx bench --prompts real_long.jsonl --no-chat-template -b auto --repeat 3 -n 96

Unlike ``bench --context`` (token windows cut from the top-level modules,
most of which the demo target was trained on), every prompt here is a run of
whole held-out modules (``make_demo_pair.is_held_out``), never cut inside a
file: the text a draft meets when a user pastes files it has not seen. Each
size class (the JSONL ``category``: 1k, 2.5k and 3.8k tokens by default) has
``--per-class`` prompts, each starting at another module; a module is taken
when the prompt stays within 5% above the class's size, and the prompt ends
once it holds 90% of it. The same Python and tokenizer give the same file.
"""

import argparse
import json
import sysconfig
from pathlib import Path

from make_demo_pair import is_held_out, read, stdlib_files

from mlx_lm.utils import load_tokenizer

from dflash_mlx.atomic import write_text
from dflash_mlx.demo import demo_pair


def held_out_modules() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in stdlib_files() if is_held_out(str(p.relative_to(root)))]


def class_prompt(texts: list[str], sizes: list[int], start: int, tokens: int) -> str:
    """Whole modules from ``start`` on (wrapping round) while the prompt stays
    within 5% above ``tokens``, until it holds at least 90% of them."""
    chosen, total = [], 0
    for k in range(len(texts)):
        i = (start + k) % len(texts)
        if total + sizes[i] <= 1.05 * tokens:
            chosen.append(texts[i])
            total += sizes[i]
        if total >= 0.9 * tokens:
            return "\n".join(chosen)
    raise SystemExit(f"the held-out modules cannot make a prompt of about {tokens} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSONL prompt file to write")
    ap.add_argument("--model", default=str(demo_pair().target), help="whose tokenizer counts the tokens")
    ap.add_argument("--tokens", default="1000,2500,3800", help="the size classes, in tokens")
    ap.add_argument("--per-class", type=int, default=3)
    args = ap.parse_args()
    tokenizer = load_tokenizer(Path(args.model))
    texts = [read(p) for p in held_out_modules()]
    sizes = [len(tokenizer.encode(t)) for t in texts]
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        name = f"{n / 1000:g}k"
        for j in range(args.per_class):
            text = class_prompt(texts, sizes, j * len(texts) // args.per_class, n)
            rows.append({"id": f"real{name}-{j + 1}", "category": name, "prompt": text})
    write_text(Path(args.out), "".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        print(r["id"], len(tokenizer.encode(r["prompt"])), "tokens")


if __name__ == "__main__":
    main()
