"""A tiny target whose greedy reply is scripted: reasoning, an answer and a tool call.

Every layer's output projections (``o_proj``, ``down_proj``) are zero, so the
residual stream at a position is that token's embedding and the next token
depends on the current one alone. Scripted tokens get orthogonal embeddings
and the head maps each to its chosen successor; every other token's embedding
points at EOS. The tokenizer is the tiny byte-level BPE of ``checkpoints``
plus Qwen-style markers as added tokens, with a small Qwen-style chat template
that renders tools, tool calls and tool results and opens a thinking block.
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
CALL_JSON = '{"name":"get_weather","arguments":{"city":"Paris"}}'
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# the reply after an open "<think>": reasoning, "</think>", answer, one call, EOS
SCRIPT = ["<think>", *(" " + w for w in REASONING.split()), "</think>", *(" " + w for w in ANSWER.split()),
          "<tool_call>", *PIECES[6:], "</tool_call>", "<|im_end|>"]

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


def write_scripted_target(path: Path, tools: bool = True) -> dict:
    """Save the scripted llama target at ``path``: with the tools-and-thinking
    template, or (``tools=False``) a plain one. Returns its config."""
    path = Path(path)
    tok = _write_tokenizer(path, TOOLS_TEMPLATE if tools else PLAIN_TEMPLATE)
    ids = [tok.token_to_id(t if t in MARKERS + PIECES else "\u0120" + t[1:]) for t in SCRIPT]
    assert None not in ids, dict(zip(SCRIPT, ids))
    eos = tok.token_to_id("<|im_end|>")
    model, config = build_target("llama", eos_token_id=eos, vocab_size=VOCAB)
    H = config["hidden_size"]
    # dim 0 is EOS's direction; dim 1 + i is the i-th scripted token's
    embed = np.zeros((VOCAB, H), np.float32)
    embed[:, 0] = 1.0
    embed[:, len(ids) + 1:] = np.random.default_rng(0).normal(0.0, 0.05, (VOCAB, H - len(ids) - 1))
    head = np.zeros((VOCAB, H), np.float32)
    head[eos, 0] = 1.0
    for i, (token, successor) in enumerate(zip(ids, ids[1:])):
        embed[token] = 0.0
        embed[token, 0], embed[token, 1 + i] = 0.1, 1.0
        head[successor, 1 + i] = 10.0
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros(p.shape, np.float32)
        elif name.endswith("norm.weight"):
            weights[name] = np.ones(p.shape, np.float32)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=False)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    return config
