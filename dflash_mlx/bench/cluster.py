"""``dflash-mlx bench --predict --machines N --link L``: the expected DFlash
speedup for a target sharded over N Macs with MLX distributed
(docs/distributed.md, "What to expect").

Every pass of a sharded target adds cross-machine rounds to the one-machine
roofline of ``cost_model``:

- tensor parallel: each machine reads and computes 1/N of the pass (weights,
  experts, KV cache and states are split by heads and rows); every layer sums
  its attention and its MLP outputs over the machines, 2 all-reduces of
  tokens x hidden activations per layer, and an untied head split over the
  vocabulary gathers its logits (the draft's rows too);
- pipeline: the machines run their stages one after another, so a pass takes
  the one-machine time of the whole model, plus a hand-off of the hidden state
  at each of the N-1 stage boundaries and the final collective (mlx-lm's
  all-gather of the last hidden state; dflash-mlx's one all-reduce of the
  tapped features and that state).

A collective over a ring of N machines (MLX's ring backend, and JACCL's):
an all-reduce is 2(N-1) steps, an all-gather N-1, each step one link latency
plus 1/N of the message at the link's bandwidth; a hand-off is one step with
the whole message. The number of steps per pass does not depend on how many
tokens the pass holds: a verify pass of b tokens costs the rounds of one
decode step, with b times the bytes. The draft runs whole on every machine.
"""

import math
from dataclasses import asdict, dataclass
from typing import Optional

from .. import validate
from ..draft import DraftConfig
from ..errors import DFlashError
from . import cost_model as cm
from .chips import find_chips
from .presets import PRESETS
from .render import console
from .report import write_json

MODES = ("tensor", "pipeline")
ACTIVATION_BYTES = 2  # bfloat16 activations cross the link (quantized weights compute in bf16)


@dataclass(frozen=True)
class Link:
    """A machine-to-machine link as the cost model sees it."""

    name: str
    latency_us: float  # one step of a collective: a small message from one machine to the next
    bandwidth_gbs: float  # GB/s one way
    source: str


_TCP = ("~300 us per operation over TCP (IP over Thunderbolt), against under 50 us with RDMA: Apple TN3205 "
        "'Low-latency communication with RDMA over Thunderbolt' (March 2026), as reported by "
        "adwaitx.com and wpnews.pro")
LINKS: dict[str, Link] = {
    "tb5": Link("Thunderbolt 5, RDMA (JACCL backend, macOS 26.2+)", 8.0, 6.25,
                "latency: 5-9 us reported by users of RDMA over Thunderbolt 5 (techboards.net, 'macOS 26.2 "
                "adds InfiniBand over Thunderbolt support'), upper end; bandwidth: 50-60 Gb/s reported for "
                "JACCL (wpnews.pro, 'MLX + JACCL'), lower end"),
    "tb5-ring": Link("Thunderbolt 5, TCP (ring backend)", 300.0, 10.0,
                     f"latency: {_TCP}; bandwidth: Thunderbolt 5's 80 Gb/s each way, an upper bound for TCP"),
    "tb4-ring": Link("Thunderbolt 4, TCP (ring backend)", 300.0, 5.0,
                     f"latency: assumed as Thunderbolt 5 over TCP ({_TCP}); bandwidth: Thunderbolt 4's 40 Gb/s, "
                     "an upper bound for TCP"),
}


def find_link(name: str, latency_us: Optional[float] = None, bandwidth_gbs: Optional[float] = None) -> Link:
    """``--link`` by name, with ``--link-latency-us`` / ``--link-gbs`` in place of its figures."""
    if name not in LINKS:
        raise DFlashError(f"unknown --link '{name}'; known: {', '.join(LINKS)} "
                          "(or any of them with --link-latency-us and --link-gbs)")
    link = LINKS[name]
    if latency_us is None and bandwidth_gbs is None:
        return link
    if latency_us is not None:
        validate.real(latency_us, "--link-latency-us", low=0.0)
    if bandwidth_gbs is not None and not (math.isfinite(bandwidth_gbs) and bandwidth_gbs > 0):
        raise DFlashError(f"--link-gbs must be a positive number, got {bandwidth_gbs}")
    return Link(f"{link.name}, figures overridden",
                link.latency_us if latency_us is None else latency_us,
                link.bandwidth_gbs if bandwidth_gbs is None else bandwidth_gbs,
                "given on the command line" + ("" if latency_us is not None and bandwidth_gbs is not None
                                               else f"; the rest: {link.source}"))


@dataclass(frozen=True)
class Comm:
    """The cross-machine part of one pass: latency-bound steps and bytes each machine sends."""

    steps: int
    bytes: float

    def seconds(self, link: Link) -> float:
        return self.steps * link.latency_us * 1e-6 + self.bytes / (link.bandwidth_gbs * 1e9)

    def __add__(self, other: "Comm") -> "Comm":
        return Comm(self.steps + other.steps, self.bytes + other.bytes)


def all_reduce(message: float, machines: int) -> Comm:
    return Comm(2 * (machines - 1), 2 * (machines - 1) * message / machines)


def all_gather(total: float, machines: int) -> Comm:
    return Comm(machines - 1, (machines - 1) * total / machines)


@dataclass(frozen=True)
class Shape:
    """What crosses the link, from the target's config and the draft's taps."""

    layers: int
    hidden: int
    vocab: int
    tied: bool  # a tied head is not split (mlx-lm's shard), so no logits are gathered
    features: int  # tapped layers the draft reads

    @classmethod
    def of(cls, target_cfg: dict, draft_cfg: dict) -> "Shape":
        text = cm.text_config(target_cfg)
        tied = bool(target_cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return cls(int(text["num_hidden_layers"]), int(text["hidden_size"]), int(text["vocab_size"]), tied,
                   len(DraftConfig.from_dict(draft_cfg).target_layer_ids))


def pass_comm(shape: Shape, mode: str, machines: int, tokens: int, logits_rows: int, dflash: bool) -> Comm:
    """What one target pass over ``tokens`` positions sends: mlx-lm's own
    (``dflash`` False) or dflash-mlx's, which also gathers the draft's features."""
    act = tokens * shape.hidden * ACTIVATION_BYTES
    if mode == "tensor":
        comm = Comm(0, 0.0)
        for _ in range(2 * shape.layers):
            comm += all_reduce(act, machines)
        if not shape.tied and logits_rows:
            comm += all_gather(logits_rows * shape.vocab * ACTIVATION_BYTES, machines)
        return comm
    hand_offs = Comm(machines - 1, (machines - 1) * act)
    if dflash:
        return hand_offs + all_reduce(act * (shape.features + 1), machines)
    return hand_offs + all_gather(machines * act, machines)


def _split(p: cm.Pass, machines: int) -> cm.Pass:
    return cm.Pass(p.bytes / machines, p.flops / machines)


@dataclass
class ClusterPrediction:
    chip: str
    machines: int
    mode: str
    block_size: int
    tau: float
    step_steps: int  # latency-bound steps of a decode step's collectives
    verify_steps: int  # the same of a verify pass over the block
    step_comm_bytes: float  # bytes one machine sends per decode step
    verify_comm_bytes: float
    step_ms: float
    step_comm_ms: float
    draft_ms: float
    verify_ms: float
    verify_comm_ms: float
    ar_tps: float
    dflash_tps: float
    speedup: float

    def to_dict(self) -> dict:
        return asdict(self)


def predict(tp: cm.TargetProfile, dp: cm.DraftProfile, shape: Shape, chip, link: Link, machines: int,
            mode: str, tau: float, block_size: int, context: int) -> ClusterPrediction:
    """mlx-lm's decoding and DFlash's chain of ``block_size``, on ``machines``
    Macs of ``chip`` sharding the target by ``mode`` over ``link``."""
    if mode not in MODES:
        raise DFlashError(f"--distributed must be one of {', '.join(MODES)}, got '{mode}'")
    share = 1.0 / machines if mode == "tensor" and not shape.tied else 1.0

    def target_s(tokens: int, dflash: bool) -> tuple[float, float, Comm]:
        work = tp.forward(tokens, context, tokens)
        compute = (_split(work, machines) if mode == "tensor" else work).seconds(chip)
        comm = pass_comm(shape, mode, machines, tokens, tokens, dflash)
        return compute, comm.seconds(link), comm

    step, step_comm_s, step_comm = target_s(1, False)
    verify, verify_comm_s, verify_comm = target_s(block_size, True)
    drafting = dp.forward(tp, block_size, context, tau, head_share=share).seconds(chip)
    if share < 1.0:  # the draft's logits rows, split over the vocabulary like the target's, are gathered
        drafting += all_gather((block_size - 1) * shape.vocab * ACTIVATION_BYTES, machines).seconds(link)
    t_step = step + step_comm_s
    t_cycle = drafting + verify + verify_comm_s
    return ClusterPrediction(
        chip=chip.name, machines=machines, mode=mode, block_size=block_size, tau=tau,
        step_steps=step_comm.steps, verify_steps=verify_comm.steps,
        step_comm_bytes=step_comm.bytes, verify_comm_bytes=verify_comm.bytes,
        step_ms=1e3 * t_step, step_comm_ms=1e3 * step_comm_s, draft_ms=1e3 * drafting,
        verify_ms=1e3 * (verify + verify_comm_s), verify_comm_ms=1e3 * verify_comm_s,
        ar_tps=1 / t_step, dflash_tps=tau / t_cycle, speedup=tau * t_step / t_cycle,
    )


def main_predict_cluster(*, model: Optional[str], draft: Optional[str], preset: Optional[str],
                         tau: Optional[float], block_sizes: Optional[list[int]], chips: Optional[list[str]],
                         context: int, dtype: Optional[str], machines: int, link: Link, modes: list[str],
                         json_out: Optional[str], out=None, err=None) -> dict:
    """Predict for a cluster, print the table and return (and with ``json_out`` write) the report."""
    from rich.table import Table

    from .predict import _configs

    out = out or console()
    err = err or console(stderr=True)
    validate.integer(machines, "--machines", low=2)
    validate.integer(context, "--context", low=0)
    target_cfg, draft_cfg, names, _, preset_tau = _configs(model, draft, preset, None)
    trained = DraftConfig.from_dict(draft_cfg).block_size
    if tau is None and preset_tau is None:
        raise DFlashError("--predict --machines needs tau: give --tau T or --preset NAME")
    tau0, b0 = (tau, (block_sizes or [trained])[0]) if tau is not None else (preset_tau, trained)
    if not 1.0 <= tau0 <= b0:
        raise DFlashError(f"tau must lie in [1, {b0}], got {tau0:g}")
    tp, dp = cm.target_profile(target_cfg, dtype), cm.draft_profile(draft_cfg, dtype)
    shape = Shape.of(target_cfg, draft_cfg)
    rows = []
    for chip in find_chips(chips):
        for mode in modes:
            for b in block_sizes or [b0]:
                t = tau0 if b == b0 else min(cm.tau_at(b, tau0, b0), b)
                rows.append(predict(tp, dp, shape, chip, link, machines, mode, t, b, context).to_dict())
    gb = tp.weight_bytes / 1e9
    out.print(f"target {names[0]}: {tp.params / 1e9:.1f} B parameters, {gb:.1f} GB of weights, "
              f"{gb / machines:.1f} GB per machine over {machines}; draft {names[1]} on every machine")
    out.print(f"link: {link.name}: {link.latency_us:g} us per step, {link.bandwidth_gbs:g} GB/s ({link.source})")
    table = Table(title=f"predicted decode speed on {machines} Macs at {context} tokens of context")
    for col in ("chip", "mode", "b", "tau", "link steps", "KB/step", "KB/verify", "link ms step",
                "link ms verify", "mlx-lm tok/s", "DFlash tok/s", "speedup"):
        table.add_column(col, justify="left" if col in ("chip", "mode") else "right")
    for r in rows:
        steps = str(r["step_steps"]) + ("" if r["verify_steps"] == r["step_steps"] else f"/{r['verify_steps']}")
        table.add_row(r["chip"], r["mode"], str(r["block_size"]), f"{r['tau']:.2f}", steps,
                      f"{r['step_comm_bytes'] / 1e3:.1f}", f"{r['verify_comm_bytes'] / 1e3:.1f}",
                      f"{r['step_comm_ms']:.2f}", f"{r['verify_comm_ms']:.2f}", f"{r['ar_tps']:.1f}",
                      f"{r['dflash_tps']:.1f}", f"{r['speedup']:.2f}x")
    out.print(table)
    out.print("link steps: latency-bound steps of one target pass, as many for a verify pass of b tokens as for "
              "a decode step (pipeline: step/verify, dflash-mlx's final all-reduce of the draft's features "
              "against mlx-lm's all-gather); KB: what each machine sends per pass; speedup: DFlash over mlx-lm "
              "sharded the same way on the same machines (memory and compute overlapped, link time added).")
    report = {"schema": "dflash-mlx-predict-cluster", "schema_version": 1,
              "target": {"name": names[0], "params": tp.params, "weight_bytes": tp.weight_bytes},
              "draft": {"name": names[1], "params": dp.params}, "context": context, "machines": machines,
              "link": asdict(link), "predictions": rows}
    if json_out:
        write_json(report, json_out)
        err.print(f"wrote {json_out}")
    return report
