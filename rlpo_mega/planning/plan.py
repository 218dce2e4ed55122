"""`rlpo-mega plan`: a recipe at its real size on a CPU -- no GPU, no weights, no prompts file, no process group of
its size. What depends on size is checked here, at the size, so that a shrunk test run cannot hide it:

- the step plan: K steps of the real planner (rlpo_mega.data.packing.plan_step) on drawn response lengths; any
  refusal is the recipe's failure;
- every learner GPU (one row per pipeline stage): the model's parameters, gradients and optimizer state as
  megatron-core allocates them (meta_build, exact) plus the largest planned micro-batch's activations, logits,
  log-prob chunk, routes and the exchange's buffers (estimates, memory.py);
- every SGLang server GPU: weights at its TP, the KV pool mem_fraction_static leaves, the weight sync's and
  the digest hook's transients, whether the requests in flight fit the pool;
- every host: the checkpoint's save and load transients, the rollout drivers' buffers; the checkpoint's size
  and the time its save needs against the SIGTERM lead time of launch/slurm.

One table per role with the budget and the headroom; the first budget exceeded is the one line of a failure.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import dataclass
from typing import Optional

from moe.context_parallel import padded_length
from moe.families import get_family
from moe.model import load_hf_config
from moe.routing.trace import compact_dtype
from rlpo_mega.checkpoint.distopt import dp_shares
from rlpo_mega.config import response_budget
from rlpo_mega.config_checks import check_run_config
from rlpo_mega.data.packing import aligned, plan_step
from rlpo_mega.distributed import resolve_layout
from rlpo_mega.planning import memory
from rlpo_mega.planning.meta_build import Request, run_cached as meta_run
from rlpo_mega.planning.refit import Refit, refit_plan, render_refit
from rlpo_mega.planning.rows import GB, EnginePlan, PlanError, Row  # noqa: F401  (PlanError: the CLI's)
from rlpo_mega.rollout import ENGINES
from rlpo_mega.rollout.producers import PRODUCERS
from rlpo_mega.shares import share_of

LENGTH_DISTS = ("uniform", "heavy-tail", "all-max")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the rollout engine's default share of a GPU for weights + KV pool when the recipe does not state it


def quiet_megatron():
    """Megatron's import-time notes about TE and Apex and its INFO logs are noise in a plan's output."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.WARNING)


# ---- response lengths
def response_lengths(spec: str, max_new: int, n: int, steps: int, seed: int) -> list[list[int]]:
    """`steps` lists of `n` response lengths: a distribution (LENGTH_DISTS) or a file (a JSON array of lengths,
    or a run's metrics.jsonl: each step's mean, max and truncated fraction)."""
    rng = random.Random(seed)
    if spec == "uniform":
        return [[rng.randint(1, max_new) for _ in range(n)] for _ in range(steps)]
    if spec == "heavy-tail":  # long-CoT: most answers short, a long tail, some cut at the limit
        return [[min(max_new, max(1, int(rng.lognormvariate(math.log(max_new / 6), 1.0)))) for _ in range(n)]
                for _ in range(steps)]
    if spec == "all-max":
        return [[max_new] * n for _ in range(steps)]
    if not os.path.isfile(spec):
        raise PlanError(f"--lengths {spec!r} is neither a distribution ({', '.join(LENGTH_DISTS)}) nor a file")
    with open(spec) as f:
        text = f.read()
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        values = None
    if isinstance(values, list):
        if not values or not all(isinstance(v, int) and v >= 1 for v in values):
            raise PlanError(f"--lengths {spec}: a JSON array of response lengths (integers >= 1) was expected")
        return [[min(max_new, rng.choice(values)) for _ in range(n)] for _ in range(steps)]
    return _lengths_from_metrics(spec, text, max_new, n, steps, rng)


def _lengths_from_metrics(spec, text, max_new, n, steps, rng):
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise PlanError(f"--lengths {spec}: neither a JSON array nor a metrics.jsonl (a line is not JSON)") from None
        if "response/length_mean" in row:
            rows.append(row)
    if not rows:
        raise PlanError(f"--lengths {spec}: no step with response/length_mean (a run's metrics.jsonl was expected)")
    out = []
    for k in range(steps):  # the last `steps` logged steps, each: its truncated share at the limit, the rest
        row = rows[-steps:][k % min(steps, len(rows))]  # exponential with the remaining mean, capped at its max
        cut = round(n * row.get("response/truncated_frac", 0.0))
        mean, top = row["response/length_mean"], min(max_new, int(row.get("response/length_max", max_new)))
        rest_mean = max(1.0, (mean * n - cut * max_new) / max(1, n - cut))
        out.append([max_new] * cut + [min(top, max(1, int(rng.expovariate(1 / rest_mean)))) for _ in range(n - cut)])
    return out


# ---- the step plan
@dataclass
class StepSummary:
    steps: int = 0
    largest_micro_tokens: int = 0  # aligned tokens of the largest micro-batch any rank runs
    most_micro_batches: int = 0  # per rank and mini-batch
    largest_rank_tokens: int = 0  # one DP rank's tokens of one step (the exchange's receive)
    step_tokens: int = 0  # the largest step's tokens
    driver_tokens: int = 0  # the most tokens one engine rank (rollout driver) generates and sends in a step
    efficiency: float = 1.0  # the worst packing efficiency


def simulate_steps(cfg, dp: int, tp: int, lengths: list[list[int]], prompt_tokens: int, drivers: int = 1,
                   cp: int = 1) -> StepSummary:
    """drivers: the engine ranks; each generates a contiguous share of a step's prompts (rollout/producers.share).
    cp: context parallelism, under which each sample counts padded to 2 x cp x tp (training/batches.py) and a
    micro-batch's tokens are its CP group's."""
    t, s = cfg.trainer, StepSummary()
    n = cfg.prompts.n_samples
    for k, responses in enumerate(lengths):
        real = [prompt_tokens + r - 1 for r in responses]
        spans = [padded_length(x, cp, tp) for x in real] if cp > 1 else real
        try:
            plan = plan_step(spans, t.mini_batches, dp, cfg.parallel.num_micro_batches,
                             t.max_tokens_per_micro_batch, t.layout, align=tp)
        except ValueError as e:
            raise PlanError(f"step plan, drawn step {k + 1}: {e}") from None
        s.steps += 1
        width = aligned(max(spans), tp)
        for mini in plan.micro:
            for rank in mini:
                s.most_micro_batches = max(s.most_micro_batches, len(rank))
                for mb in rank:
                    tokens = (max(len(mb), 1) * width if t.layout == "padded"
                              else aligned(max(sum(spans[i] for i in mb), 1), tp))
                    s.largest_micro_tokens = max(s.largest_micro_tokens, tokens)
        per_rank = [0] * dp
        for i, d in plan.dp_of().items():
            per_rank[d] += prompt_tokens + responses[i]
        s.largest_rank_tokens = max(s.largest_rank_tokens, max(per_rank))
        s.step_tokens = max(s.step_tokens, sum(prompt_tokens + r for r in responses))
        for d in range(drivers):
            groups = share_of(range(len(responses) // n), d, drivers)
            mine = responses[groups[0] * n:(groups[-1] + 1) * n] if groups else []
            s.driver_tokens = max(s.driver_tokens, sum(prompt_tokens + r for r in mine))
        s.efficiency = min(s.efficiency, sum(real) / plan.computed_tokens(spans, tp))
    return s


# ---- roles
def _request(cfg, layout, value_head: bool) -> Request:
    optim = cfg.critic.optim if value_head else cfg.optim
    lora = cfg.critic.lora if value_head else cfg.model.lora
    return Request(cfg.model.hf_config, layout, cfg.model.params_dtype, cfg.model.vocab_divisible_by,
                   optim.use_distributed_optimizer, value_head=value_head, recompute=cfg.model.recompute,
                   lora=(lora.rank, lora.alpha, tuple(lora.targets), lora.expert_layout) if lora.rank else ())


def _stage_layers(hf, pp: int, stage: int) -> range:
    per = hf.num_hidden_layers // pp
    return range(stage * per, (stage + 1) * per)


def learner_rows(cfg, hf, layout, steps: StepSummary, built: list, critic: Optional[list], budget: int,
                 reserved: int, imbalance: float, engine_ranks: list[int], engine: EnginePlan) -> list[Row]:
    shape = memory.Shape.of(hf, cfg.model.vocab_divisible_by, layout.tensor)
    tp, pp = layout.tensor, layout.pipeline
    # under context parallelism each GPU of a CP group runs 1/cp of the micro-batch's (padded) row: its
    # activations, logits and routes; TE's CP attention (p2p) keeps only the local K/V for the backward
    tokens = steps.largest_micro_tokens // layout.context
    family = get_family(hf.model_type)
    topk = shape.topk
    route_item = compact_dtype(family.num_experts(hf)).itemsize  # the exchange's wire dtype of a route
    driver_stages = {_stage_of(r, layout) for r in engine_ranks}
    rows = []
    for s, rank in enumerate(built):
        stage = rank["stage"]
        layers = _stage_layers(hf, pp, stage)
        moe_here = sum(shape.moe_layers[i] for i in layers)
        policy = memory.model_bytes(rank, cfg.optim.use_distributed_optimizer, offload=memory.Offload.of(cfg.optim))
        row = Row("learner GPU", f"stage {stage}" if pp > 1 else "every rank", budget)
        row.info["parameters"] = policy.params
        if cfg.model.lora.rank:  # the adapters: what has gradients and optimizer state
            row.info["trainable"] = rank["trainable_params"]
        row.parts.update(params=policy.param_bytes, grads=policy.grad_bytes, optimizer=policy.optimizer_bytes)
        if critic is not None:
            value = memory.model_bytes(critic[s], cfg.critic.optim.use_distributed_optimizer,
                                       offload=memory.Offload.of(cfg.critic.optim))
            row.info["critic parameters"] = value.params
            row.parts["critic"] = value.param_bytes + value.optimizer_bytes
            row.parts["critic grads"] = value.grad_bytes
        if cfg.algorithm.kl.coef > 0:  # the KL reference: the policy's weights again, without DDP or optimizer
            row.parts["reference"] = rank["param_bytes"] + rank["module_buffer_bytes"]
        in_flight = pp - stage if pp > 1 else 1
        row.parts["activations"] = memory.activation_bytes(shape, tokens, tp, layers, cfg.model.recompute, in_flight,
                                                           imbalance)
        if stage == pp - 1:
            row.parts["logits"] = memory.logits_bytes(shape, tokens, tp)
            row.parts["logprob chunk"] = memory.logprob_chunk_bytes(shape, tokens, tp)
        if cfg.routing.mode != "off" and moe_here:
            row.parts["routes"] = memory.route_bytes(moe_here, topk, tokens, tp)
        # the exchange (training/exchange.py): all_to_alls of a step's payload on the device: token ids and
        # log-probs (4 B each), this stage's routes per input position; the receive holds the rank's share, the
        # send on an SGLang driver its share of the step (rollout.sglang.drivers split the prompts); in rounds of
        # at most trainer.exchange_round_mb sent and received, each copied to the host before the next
        per_token = 8 + (moe_here * topk * route_item if cfg.routing.mode == "r3" else 0)
        recv = steps.largest_rank_tokens * per_token
        send = steps.driver_tokens * (8 + sum(shape.moe_layers) * topk * route_item) \
            if engine.driver_sends_all_layers and stage in driver_stages else recv
        row.parts["exchange"] = min(recv + send, 2 * (cfg.trainer.exchange_round_mb << 20))
        bucket = cfg.rollout.sync_bucket_mb << 20
        # rollout.weights=fp8 (moe/bridge/fp8.QuantizedStream): a receiving rank also holds the bucket's codes and
        # scales (at most half its bf16 bytes), and sglang_distributed packs the quantised bucket into one uint8
        # tensor (at most the bucket)
        fp8 = (bucket // 2 + (bucket if cfg.rollout.sync_transport == "sglang_distributed" else 0)
               if cfg.rollout.weights == "fp8" else 0)
        if engine.gpu_sync:  # colocated servers: every GPU receives each bucket and makes its server rank's copy
            row.parts["sync bucket"] = engine.gpu_sync + fp8
        elif stage in driver_stages:  # an engine rank receives the full weights at each sync, a bucket at a time
            row.parts["sync bucket"] = bucket + fp8
        row.parts["reserved"] = reserved
        row.info["micro-batch tokens"] = steps.largest_micro_tokens
        if layout.context > 1:
            row.info["tokens per GPU (CP)"] = tokens
        rows.append(row)
    return rows


# what the learner moves to the host for generation (its weights, accelerator optimizer state, the KL reference and
# the critic; the gradients are dropped) and back: part names of a learner row
_LEARNER_KEPT = ("params", "optimizer", "reference", "critic")
_LEARNER_STATE = _LEARNER_KEPT + ("grads", "critic grads")
# an engine's parts (server_rows, the embedded engine's) resident while it generates, and at a sync (the weights
# resumed; the digest hook's tensors; the update's tensors are the learner's bucket, opened by CUDA IPC)
_ENGINE_GENERATING = ("weights", "KV pool", "KV cache", "runtime")
_ENGINE_SYNCING = ("weights", "digest", "runtime")


def colocated_rows(learner: list[Row], engine: dict, released: int) -> list[Row]:
    """rollout.colocate: each learner GPU row split by phase (training/colocate.py's order).
    training: the learner's row, and what the released engine keeps (`released`);
    generation: what the learner leaves resident (its reserved share: CUDA context, NCCL) and the engine (`engine`:
    part -> bytes: weights, KV cache or pool, runtime);
    sync: the learner's weights, gradients and optimizer state, its reserved share and sync bucket, and the engine's
    weights (resumed before the sync, the KV cache after it)."""
    rows = []
    for row in learner:
        train = Row(row.role, f"{row.name}, training", row.budget, dict(row.parts), dict(row.info), list(row.notes))
        if released:
            train.parts["engine (released)"] = released
        gen = Row(row.role, f"{row.name}, generation", row.budget)
        gen.parts.update({"reserved": row.parts["reserved"], **{f"engine {k}": v for k, v in engine.items()
                                                                if k in _ENGINE_GENERATING}})
        sync = Row(row.role, f"{row.name}, sync", row.budget)
        sync.parts.update({k: row.parts[k] for k in _LEARNER_STATE + ("sync bucket", "reserved") if k in row.parts})
        sync.parts.update({f"engine {k}": v for k, v in engine.items() if k in _ENGINE_SYNCING})
        rows += [train, gen, sync]
    return rows


def handover(cfg, learner: list[Row], engine_copy: int) -> dict:
    """Bytes per GPU per step moved between accelerator and host (rollout.colocate), and their time at
    cluster.host_device_gb_per_s: the learner's kept state out and back, the embedded engine's weights (copied to
    the host while the learner trains) out and back."""
    moved = max(sum(r.parts.get(k, 0) for k in _LEARNER_KEPT) for r in learner) + engine_copy
    return {"bytes_per_gpu": 2 * moved, "seconds": 2 * moved / (cfg.cluster.host_device_gb_per_s * GB),
            "host_device_gb_per_s": cfg.cluster.host_device_gb_per_s}


def total_params(built: list, layout) -> int:
    """Parameters of the whole model, as the engines serve it (LoRA's factors merged, not counted): each stage's dense
    part times TP, its experts times EP x ETP (the norms, replicated over TP, are counted TP times: a few hundred
    thousand parameters)."""
    return sum((r["base_params"] - r["base_expert_params"]) * layout.tensor + r["base_expert_params"] * layout.expert
               * layout.expert_tensor for r in built)


def dp_positions(layout) -> tuple[dict, dict]:
    """Every global rank's position in its dense / expert data-parallel group (megatron's rank order tp-cp-ep-dp-pp,
    parallel_state.RankGenerator)."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=layout.tensor, ep=1, dp=layout.data, pp=layout.pipeline, cp=layout.context,
                          order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=layout.expert_tensor, ep=layout.expert, dp=layout.expert_data, pp=layout.pipeline,
                           cp=1, order="tp-cp-ep-dp-pp")
    # the dense gradients and the distributed optimizer's shards span data x context parallel ranks
    return tuple({r: i for g in gen.get_ranks(kind) for i, r in enumerate(g)}
                 for gen, kind in ((dense, "dp-cp"), (expert, "dp")))


def _state_bytes_per_element(buffer: dict) -> int:
    # exp_avg and exp_avg_sq, and the fp32 main copy of a 16-bit parameter (an fp32 parameter is its own)
    return 8 if buffer["param_dtype"] == "float32" else 12


def optimizer_state_bytes(buffers: list, dense_position: int, expert_position: int) -> tuple[int, int]:
    """Host bytes of one rank's distributed-optimizer state at a checkpoint, as rlpo_mega.checkpoint.distopt holds
    it: (save: the parameters the rank owns, load: the parameters its range touches)."""
    save = load = 0
    for b in buffers:
        owned, touched = dp_shares(b["params"], b["buckets"], b["dp"])
        k = expert_position if b["expert"] else dense_position
        save += _state_bytes_per_element(b) * owned[k]
        load += _state_bytes_per_element(b) * touched[k]
    return save, load


def _stage_of(rank: int, layout) -> int:
    return rank // (layout.world_size // layout.pipeline)


def offloaded_bytes(cfg, layout, built: list, critic: Optional[list]) -> list[int]:
    """Per learner node: the optimizer state its ranks hold in host memory under optimizer CPU offload (each rank
    at its place in its DP groups: memory.model_bytes, exact at offload_fraction 1.0)."""
    nodes = max(1, layout.world_size // cfg.cluster.gpus_per_node)
    dense, expert = dp_positions(layout)
    out = [0] * nodes
    for model, optim in ((built, cfg.optim), (critic, cfg.critic.optim)):
        offload = memory.Offload.of(optim)
        if model is None or offload is None:
            continue
        by_stage = {r["stage"]: r for r in model}
        for rank in range(layout.world_size):
            out[rank // cfg.cluster.gpus_per_node] += memory.model_bytes(
                by_stage[_stage_of(rank, layout)], optim.use_distributed_optimizer, dense[rank], expert[rank],
                offload).host_optimizer_bytes
    return out


def host_rows(cfg, hf, layout, built: list, steps: StepSummary, budget: int, prompt_tokens: int,
              engine_ranks: list[int], engine: EnginePlan, offloaded: Optional[list[int]] = None
              ) -> tuple[list[Row], dict]:
    """Per learner node: the checkpoint's host memory (the distributed optimizer's state a save writes and a load
    reads, optimizer_state_bytes) and the rollout drivers' buffers (the engine ranks on that node, each with its
    share of a step); and the checkpoint's size and save time
    (weights are written by their DP group's rank 0, the distributed optimizer's state by each parameter's owner)."""
    c = cfg.cluster
    nodes = max(1, layout.world_size // c.gpus_per_node)
    by_stage = {r["stage"]: r for r in built}
    dense, expert = dp_positions(layout)
    save = [0] * nodes
    load = [0] * nodes
    written = [0] * nodes
    distopt = cfg.optim.use_distributed_optimizer
    # LoRA: DDP's buffers hold the adapters alone; model.lora.save=full writes the frozen base beside them (its main
    # replicas, as the weights'), an adapter-only checkpoint (rlpo_mega.checkpoint.dist) does not; the critic's
    # frozen trunk likewise (critic.lora.save)
    base_too = bool(cfg.model.lora.rank) and not cfg.model.adapters_only()
    critic_trunk_too = bool(cfg.critic.lora.rank) and not cfg.critic.adapters_only(cfg.model)
    for rank in range(layout.world_size):
        node = rank // c.gpus_per_node
        r = by_stage[_stage_of(rank, layout)]
        for b in r["buffers"]:
            if (expert if b["expert"] else dense)[rank] == 0:  # the weights' main replica
                written[node] += memory.ITEMSIZE[b["param_dtype"]] * b["numel_unpadded"]
                if not distopt:
                    written[node] += _state_bytes_per_element(b) * b["numel_unpadded"]
        for frozen in ([r] if base_too else []) + ([r["critic"]] if critic_trunk_too and "critic" in r else []):
            if frozen.get("frozen_param_bytes"):
                expert_bytes = frozen["frozen_param_bytes"] * frozen["base_expert_params"] // max(1, frozen["base_params"])
                written[node] += ((frozen["frozen_param_bytes"] - expert_bytes) * (dense[rank] == 0)
                                  + expert_bytes * (expert[rank] == 0))
        if distopt:
            held = optimizer_state_bytes(r["buffers"], dense[rank], expert[rank])
            save[node] += held[0]
            load[node] += held[1]
            written[node] += held[0]
    rows = []
    for node in range(nodes):
        row = Row("host", f"node {node}", budget)
        # save and load never overlap: the larger of the two
        row.parts["checkpoint"] = max(save[node], load[node])
        row.info.update({"save": save[node], "load": load[node]})
        if offloaded and offloaded[node]:  # optimizer CPU offload: the masters and moments live here all along
            row.parts["optimizer offload"] = offloaded[node]
        drivers = sum(1 for r in engine_ranks if r // c.gpus_per_node == node)
        if drivers:
            # each rollout driver (engine rank) holds its share of the step's samples in their compact form (ids
            # and log-probs, uint8 routes of every MoE layer), the answers it is decoding
            # (rollout.sglang.decode_concurrency: the body, base64 of int32 rows of every hidden layer, its decoded
            # int32 and the uint8 copies) and one exchange round's send and receive buffers on the host
            # (training/exchange.py); asynchronous RL holds the samples of 1 + trainer.max_staleness steps
            # (rollout/producers/asynchronous.py)
            moe_layers = sum(get_family(hf.model_type).moe_layer_pattern(hf))
            topk = memory.Shape.of(hf, 1, 1).topk
            routes = cfg.routing.mode != "off"
            per_token = 16 + (moe_layers * topk * (1 if _num_experts(hf) <= 256 else 2) if routes else 0)
            answer = (prompt_tokens + response_budget(cfg)[0]) * hf.num_hidden_layers * topk * (16 // 3 + 4 + 2)
            decoding = engine.answers_decoding * answer
            # dynamic sampling (rollout/dynamic_sampling.GroupCollector): a chunk of oversample x the share in flight, and
            # up to max_carry_steps chunks' surplus groups carried
            ds, over = cfg.algorithm.dynamic_sampling, max(1.0, cfg.prompts.oversample)
            held = over + ds.max_carry_steps * (over - 1) if ds.enabled else 1.0
            held *= PRODUCERS.get(cfg.rollout.producer).steps_held(cfg)  # async: and the steps generating ahead
            row.parts["rollout driver"] = drivers * (int(steps.driver_tokens * held) * per_token + decoding
                                                     + 2 * (cfg.trainer.exchange_round_mb << 20))
            row.info["drivers"] = drivers
        rows.append(row)
    # the save's time is its writes: every file's checksum is taken as it is written (rlpo_mega.checkpoint.writes),
    # nothing is read back
    save_s = max(written) / (c.storage_gb_per_s * GB)
    return rows, {"checkpoint_bytes": sum(written), "largest_node_write_bytes": max(written), "save_s": save_s}


def _num_experts(hf) -> int:
    return get_family(hf.model_type).num_experts(hf)


def slurm_window(sbatch: str) -> tuple[int, int]:
    """(the SIGTERM lead time of `sbatch`, torchrun's --shutdown-timeout from launch/torchrun.sh), seconds."""
    with open(os.path.join(ROOT, "launch", "slurm", sbatch)) as f:
        lead = re.search(r"^#SBATCH --signal=B:TERM@(\d+)", f.read(), re.M)
    with open(os.path.join(ROOT, "launch", "torchrun.sh")) as f:
        shutdown = re.search(r"SHUTDOWN_TIMEOUT:-(\d+)", f.read())
    if not lead or not shutdown:
        raise PlanError(f"launch/slurm/{sbatch} or launch/torchrun.sh no longer states the SIGTERM lead time")
    return int(lead[1]), int(shutdown[1])


# ---- the whole plan
@dataclass
class Plan:
    config: str
    world_size: int
    layout: dict
    steps: StepSummary
    rows: list  # Row
    checkpoint: dict
    warnings: list
    refit: Optional[Refit] = None  # each weight-sync transport's traffic and time (make_plan(refit=True))

    def first_exceeded(self) -> Optional[str]:
        for row in self.rows:
            if row.problem:
                return f"{row.role} {row.name}: {row.problem}"
            if row.headroom < 0:
                worst = max(row.parts, key=row.parts.get)
                return (f"{row.role} {row.name}: {row.total / GB:.1f} GB needed, {row.budget / GB:.0f} GB budget "
                        f"(largest part: {worst} {row.parts[worst] / GB:.1f} GB)")
        ck = self.checkpoint
        if ck.get("window_s") is not None and ck["sigterm_save_s"] > ck["window_s"]:
            return (f"pre-emption: a SIGTERM save needs {ck['sigterm_save_s']:.0f} s ({ck['largest_node_write_bytes'] / GB:.0f}"
                    f" GB from the busiest node at cluster.storage_gb_per_s={ck['storage_gb_per_s']}), the window "
                    f"is {ck['window_s']} s ({ck['window_from']}): raise the lead time there")
        return None

    def to_json(self) -> dict:
        return {
            "config": self.config, "world_size": self.world_size, "layout": self.layout,
            "steps": self.steps.__dict__, "checkpoint": self.checkpoint, "warnings": self.warnings,
            "exceeded": self.first_exceeded(),
            "refit": None if self.refit is None else self.refit.to_json(),
            **{role: [{"name": r.name, "budget": r.budget, "total": r.total, "headroom": r.headroom, **r.parts,
                       **{k.replace(" ", "_"): v for k, v in r.info.items()}, "notes": r.notes}
                      for r in self.rows if r.role == name] for role, name in
               (("learner_gpus", "learner GPU"), ("servers", "server GPU"), ("hosts", "host"))},
        }


def make_plan(cfg, config_name: str, world_size: Optional[int] = None, lengths: str = "uniform", steps: int = 20,
              prompt_tokens: int = 512, seed: int = 0, imbalance: float = 2.0, refit: bool = False) -> Plan:
    """Plan `cfg` at `world_size` (None: cluster.learner_nodes x cluster.gpus_per_node). Raises PlanError (or
    ConfigError) for what cannot run at all; budgets exceeded are reported by Plan.first_exceeded. refit: also each
    weight-sync transport's traffic and time (planning/refit.py; SGLang servers; `rlpo-mega plan` asks for it,
    `check` does not: it is no budget)."""
    c = cfg.cluster
    if world_size is None:
        if not c.learner_nodes:
            raise PlanError("no world size: pass --world-size (nodes x GPUs per node) or set cluster.learner_nodes")
        world_size = c.learner_nodes * c.gpus_per_node
    hf = load_hf_config(cfg.model.hf_config)
    warnings = check_run_config(cfg, hf, world_size=world_size, log_warnings=False, files=False)
    layout = resolve_layout(cfg.parallel, world_size, hf)
    engine_cls = ENGINES.get(cfg.rollout.engine)
    engine_cls.plan_check(cfg)  # refused before the meta build
    batch = cfg.prompts.prompts_per_step * cfg.prompts.n_samples
    drawn = response_lengths(lengths, response_budget(cfg)[0], batch, steps, seed)
    engine_ranks = engine_cls.ranks(cfg, world_size)
    summary = simulate_steps(cfg, layout.data, layout.tensor, drawn, prompt_tokens, drivers=len(engine_ranks),
                             cp=layout.context)
    built = meta_run(_request(cfg, layout, value_head=False))
    critic = meta_run(_request(cfg, layout, value_head=True)) if cfg.algorithm.advantage.name == "gae" else None
    gpu = int(c.gpu_memory_gb * GB)
    n_params = total_params(built, layout)
    engine = engine_cls.plan(cfg, hf, world_size, n_params, gpu, prompt_tokens)
    rows = learner_rows(cfg, hf, layout, summary, built, critic, gpu, int(c.gpu_reserved_gb * GB), imbalance,
                        engine_ranks, engine)
    hand = None
    if cfg.rollout.colocate:
        hand = handover(cfg, rows, engine.host_copy)
        rows = colocated_rows(rows, engine.colocated, engine.released)
        for row in engine.servers:
            row.notes.append("on the learner's GPUs (rollout.colocate): see the learner rows' generation phase")
    rows += engine.servers
    # the critic's weights and optimizer state are saved in the same checkpoints, by the same ranks
    saved = built if critic is None else [{**r, "buffers": r["buffers"] + v["buffers"], "critic": v}
                                          for r, v in zip(built, critic)]
    hosts, ck = host_rows(cfg, hf, layout, saved, summary, int(c.host_memory_gb * GB), prompt_tokens, engine_ranks,
                          engine, offloaded_bytes(cfg, layout, built, critic))
    if hand is not None:  # the learner's state (and the embedded engine's weights) on the host during the hand-over
        per_gpu = hand["bytes_per_gpu"] // 2
        for row in hosts:
            row.parts["colocate hand-over"] = per_gpu * min(c.gpus_per_node, world_size)
        ck["handover"] = hand
    rows += hosts
    sbatch = "train_disaggregated.sbatch" if c.rollout_nodes else "train_colocated.sbatch"
    lead, shutdown = slurm_window(sbatch)
    # a SIGTERM save is a regular save: its writes
    ck.update(storage_gb_per_s=c.storage_gb_per_s, sigterm_save_s=ck["save_s"], window_s=min(lead, shutdown),
              window_from=f"launch/slurm/{sbatch} --signal=B:TERM@{lead}, launch/torchrun.sh --shutdown-timeout "
                          f"{shutdown}", params=n_params + (total_params(critic, layout) if critic else 0))
    out = Plan(config_name, world_size, {"tensor": layout.tensor, "pipeline": layout.pipeline,
                                         "context": layout.context, "expert": layout.expert,
                                         "expert_tensor": layout.expert_tensor, "data": layout.data,
                                         "expert_data": layout.expert_data}, summary, rows, ck, warnings)
    if refit and cfg.rollout.engine == "sglang":
        out.refit = refit_plan(cfg, hf, layout, world_size, engine_ranks)
    return out


def _gb(x) -> str:
    return f"{x / GB:.1f}"


def render(plan: Plan) -> str:
    lay = plan.layout
    s = plan.steps
    cp = f"CP{lay['context']} " if lay.get("context", 1) > 1 else ""
    out = [f"{plan.config} at world size {plan.world_size}: TP{lay['tensor']} PP{lay['pipeline']} {cp}"
           f"EP{lay['expert']} ETP{lay['expert_tensor']} DP{lay['data']} (expert DP {lay['expert_data']})",
           f"step plan: {s.steps} drawn steps ok; largest micro-batch {s.largest_micro_tokens} tokens, up to "
           f"{s.most_micro_batches} micro-batches per rank, packing efficiency >= {s.efficiency:.3f}"]
    for role in ("learner GPU", "server GPU", "host"):
        rows = [r for r in plan.rows if r.role == role]
        if not rows:
            continue
        kinds = list(dict.fromkeys(k for r in rows for k in r.parts))
        head = [role + " (GB)"] + kinds + ["total", "budget", "headroom"]
        table = [[r.name] + [_gb(r.parts.get(k, 0)) for k in kinds] + [_gb(r.total), _gb(r.budget), _gb(r.headroom)]
                 for r in rows]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
        out.append("")
        out.append("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))))
        for line in table:
            out.append("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(line, widths))))
        for r in rows:
            extra = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in r.info.items())
            if extra or r.notes:
                out.append(f"  {r.name}: {extra}" + ("; " + "; ".join(r.notes) if r.notes else ""))
    ck = plan.checkpoint
    out += ["", f"checkpoint: {_gb(ck['checkpoint_bytes'])} GB ({ck['params']:,} parameters); a save needs "
                f"{ck['save_s']:.0f} s ({_gb(ck['largest_node_write_bytes'])} GB from the busiest node at "
                f"{ck['storage_gb_per_s']} GB/s, checksums taken as it writes); "
                f"pre-emption window {ck['window_s']} s ({ck['window_from']})"]
    if ck.get("handover"):
        h = ck["handover"]
        out.append(f"colocate hand-over: {_gb(h['bytes_per_gpu'])} GB per GPU per step between accelerator and host "
                   f"(out and back), {h['seconds']:.1f} s at cluster.host_device_gb_per_s={h['host_device_gb_per_s']}")
    if plan.refit is not None:
        out += render_refit(plan.refit)
    for w in plan.warnings:
        out.append(f"warning: {w}")
    return "\n".join(out)
