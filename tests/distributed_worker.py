"""One rank of the two-process tests in test_distributed.py (launched by them).

    python distributed_worker.py SPEC.json OUT_DIR

SPEC: {"mode": "tensor"|"pipeline"?, "runs": [{"name", "target", "draft", "prompt", "max_tokens", "options",
"curve_per_rank"?}], "refused": [target]?, "fail": {"rank", "after", "how": "exit"|"hang"}?, "timeouts": [per rank]?}.
Each run decodes with ``dflash_mlx.distributed.stream_generate`` on the
target sharded by mlx-lm's ``sharded_load`` (tensor parallel, or pipeline stages); a greedy run also
decodes with mlx-lm's own ``generate_step`` on the same sharded model. This
rank writes OUT_DIR/rank<r>.json and prints a line per response. With "fail", that rank exits or hangs after
that many responses of the first run, the way a crashed or stuck machine would.
"""

import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream

from dflash_mlx import DFlashError, distributed, load_draft
from dflash_mlx.loop.cost_curve import CostCurve


def mlx_lm_greedy(target, prompt: list[int], max_tokens: int, eos: set) -> list[int]:
    tokens = []
    for token, _ in generate_step(mx.array(prompt), target.model, max_tokens=max_tokens):
        if token in eos:
            break
        tokens.append(token)
    mx.synchronize(generation_stream)  # the step generate_step queued ahead must finish on every rank
    return tokens


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    mode = spec.get("mode", "tensor")
    group = distributed.init(mode)
    rank = group.rank()
    fail = spec.get("fail")
    results, loaded = {}, {}
    for run in spec["runs"]:
        if run["target"] not in loaded:
            loaded[run["target"]] = distributed.load(run["target"], group, mode)
        target, tokenizer = loaded[run["target"]]
        draft = load_draft(run["draft"])
        prompt = tokenizer.encode(run["prompt"])
        options = dict(run["options"])
        if "logit_bias" in options:  # JSON keys are strings
            options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
        if "curve_per_rank" in run:  # a different curve on every rank: rank 0's must win
            options["cost_curve"] = CostCurve(**{k: tuple(v) for k, v in run["curve_per_rank"][rank].items()})
        tokens, blocks = [], []
        stream = distributed.stream_generate(target, draft, tokenizer, prompt, group,
                                             timeout=spec.get("timeouts", [distributed.TIMEOUT_S] * 2)[rank],
                                             max_tokens=run["max_tokens"], **options)
        try:
            for i, response in enumerate(stream):
                if fail and fail["rank"] == rank and i == fail["after"]:
                    if fail["how"] == "exit":
                        os._exit(3)
                    time.sleep(3600)
                tokens += response.tokens
                blocks.append(response.block_size)
                print(run["name"], i, flush=True)  # progress, which keeps test_distributed's launch waiting
        except DFlashError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
        result = {"tokens": tokens, "blocks": blocks, "prompt": prompt}
        if options.get("temperature", 0.0) == 0.0:
            eos = set(tokenizer.eos_token_ids)
            result["mlx_lm"] = mlx_lm_greedy(target, prompt, run["max_tokens"], eos)
        results[run["name"]] = result
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # no rank leaves while another still needs it
    for target in spec.get("refused", []):  # targets this mode must refuse, with one line
        try:
            distributed.load(target, group, mode)
            results.setdefault("refused", {})[target] = None
        except DFlashError as e:
            results.setdefault("refused", {})[target] = str(e)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
