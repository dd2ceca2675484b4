"""A tiny target whose greedy reply is scripted: reasoning, an answer and a tool
call; after a tool result, reasoning and a final answer.

Every layer's output projections (``o_proj``, ``down_proj``) are zero but the
first layer's attention, so the residual stream at a position is that token's
embedding and the next token depends on the current one alone. Scripted tokens
get orthogonal embeddings and the head maps each to its chosen successor; every
other token's embedding points at EOS. One attention head of the first layer
reads the context: at ``</think>`` it attends to any ``</tool_response>`` before
it and writes a "tool result seen" direction, which turns the reply from the
answer and call (``SCRIPT``) to the final answer (``AFTER_TOOL``), so an agent
loop (call, result, answer) runs on it. The tokenizer is the tiny byte-level BPE
of ``checkpoints`` plus Qwen-style markers as added tokens, with a small
Qwen-style chat template that renders tools, tool calls and tool results and
opens a thinking block.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from checkpoints import build_target, write_tokenizer
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config, save_model
from tokenizers import AddedToken, Tokenizer

VOCAB = 512
MARKERS = ["<|im_start|>", "<|im_end|>"]  # special: never in decoded text
PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
          '{"name":"get_weather",', '"arguments":', '{"city":"Paris"}}']
REASONING = " the quick brown"  # base-vocabulary words, one token each
ANSWER = " hello world"
FINAL = " you can go out"  # the answer once a tool result is in the context
CALL_JSON = '{"name":"get_weather","arguments":{"city":"Paris"}}'
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# the reply after an open "<think>": reasoning, "</think>", answer, one call, EOS
SCRIPT = ["<think>", *(" " + w for w in REASONING.split()), "</think>", *(" " + w for w in ANSWER.split()),
          "<tool_call>", *PIECES[6:], "</tool_call>", "<|im_end|>"]
# the reply after "</think>" once a "</tool_response>" precedes it
AFTER_TOOL = ["</think>", *(" " + w for w in FINAL.split()), "<|im_end|>"]

TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" %}<|im_start|>assistant
{{ message.content or "" }}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}
{%- endif %}"""
PLAIN_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _write_tokenizer(path: Path, template: str) -> Tokenizer:
    base = VOCAB - len(MARKERS) - len(PIECES)
    write_tokenizer(path, base)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in MARKERS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in PIECES])
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(path / "tokenizer.json"))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(eos_token="<|im_end|>", pad_token="<|im_end|>", chat_template=template)
    config_path.write_text(json.dumps(config, indent=2))
    return tok


def _token_id(tok: Tokenizer, token: str) -> int:
    return tok.token_to_id(token if token in MARKERS + PIECES else "\u0120" + token[1:])


def _look_back_for_tool_results(weights: dict, config: dict, branch: int, marker: int, seen: int) -> None:
    """First layer, head 0: the query at dim ``branch`` meets the key at dim
    ``marker`` in the head's slowest-rotating RoPE pair (so position barely
    matters), and the value read from ``marker`` is written to dim ``seen``."""
    H, D = config["hidden_size"], config["head_dim"]
    q = np.zeros((config["num_attention_heads"] * D, H), np.float32)
    kv = np.zeros((config["num_key_value_heads"] * D, H), np.float32)
    k, v = kv.copy(), kv
    o = np.zeros((H, config["num_attention_heads"] * D), np.float32)
    q[D // 2 - 1, branch] = k[D // 2 - 1, marker] = 2.0  # score ~45: all weight on the marker
    v[0, marker] = 1.0
    o[seen, 0] = 0.2  # about as large as the branch token's own direction
    attention = "model.layers.0.self_attn."
    weights.update({attention + "q_proj.weight": q, attention + "k_proj.weight": k,
                    attention + "v_proj.weight": v, attention + "o_proj.weight": o})


def write_scripted_target(path: Path, tools: bool = True) -> dict:
    """Save the scripted llama target at ``path``: with the tools-and-thinking
    template, or (``tools=False``) a plain one. Returns its config."""
    path = Path(path)
    tok = _write_tokenizer(path, TOOLS_TEMPLATE if tools else PLAIN_TEMPLATE)
    chains = [[_token_id(tok, t) for t in chain] for chain in (SCRIPT, AFTER_TOOL)]
    assert None not in chains[0] + chains[1], [SCRIPT, AFTER_TOOL, chains]
    eos = tok.token_to_id("<|im_end|>")
    model, config = build_target("llama", eos_token_id=eos, vocab_size=VOCAB)
    H = config["hidden_size"]
    # dim 0 is EOS's direction; dim 1 + i is the i-th scripted token's; then "tool result seen"
    dims = {t: 1 + i for i, t in enumerate(dict.fromkeys(chains[0] + chains[1]))}
    marker, seen = len(dims) + 1, len(dims) + 2
    embed = np.zeros((VOCAB, H), np.float32)
    embed[:, 0] = 1.0
    embed[:, seen + 1:] = np.random.default_rng(0).normal(0.0, 0.05, (VOCAB, H - seen - 1))
    head = np.zeros((VOCAB, H), np.float32)
    head[eos, 0] = 1.0
    for token, dim in dims.items():
        embed[token] = 0.0
        embed[token, 0], embed[token, dim] = 0.1, 1.0
    response_end = tok.token_to_id("</tool_response>")
    embed[response_end] = 0.0
    embed[response_end, 0] = embed[response_end, marker] = 1.0
    for token, successor in zip(chains[0], chains[0][1:]):
        head[successor, dims[token]] = 10.0
    branch, after = chains[1][:2]
    before = chains[0][chains[0].index(branch) + 1]
    head[after, seen], head[before, seen] = 10.0, -10.0
    for token, successor in zip(chains[1][1:], chains[1][2:]):
        head[successor, dims[token]] = 10.0
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    _look_back_for_tool_results(weights, config, dims[branch], marker, seen)
    for name, p in tree_flatten(model.parameters()):
        if name.endswith(("o_proj.weight", "down_proj.weight")) and name not in weights:
            weights[name] = np.zeros(p.shape, np.float32)
        elif name.endswith("norm.weight"):
            weights[name] = np.ones(p.shape, np.float32)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=False)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    return config
