"""The SGLang engine's rows in `rlpo-mega plan` (SGLangEngine.plan): its servers at their TP, at the recipe's real
size; what a colocated server holds on a learner GPU; what its drivers hold."""
from __future__ import annotations

import math

from moe.bridge.fp8 import served_bytes
from rlpo_mega.config import response_budget
from rlpo_mega.planning import memory
from rlpo_mega.planning.rows import GB, EnginePlan, PlanError, Row
from rlpo_mega.shares import share_of

DEFAULT_MEM_FRACTION = 0.85
SGLANG_RUNTIME_GB = 4.0  # a server's CUDA graphs, activations of a prefill chunk, NCCL (assumed)


def plan(cfg, hf, n_params: int, budget: int, prompt_tokens: int) -> EnginePlan:
    """The servers' rows; colocated (rollout.colocate), a server's parts on a learner GPU while it generates and
    its runtime while released; each driver sends its whole share (every MoE layer's routes) in the exchange and
    decodes up to rollout.sglang.decode_concurrency answers' routes at once."""
    shape = memory.Shape.of(hf, 1, 1)
    servers = server_rows(cfg, hf, n_params, budget, shape.padded_vocab * shape.hidden * 2, prompt_tokens)
    routes = cfg.routing.mode != "off"
    out = EnginePlan(servers=servers, driver_sends_all_layers=True,
                     answers_decoding=cfg.rollout.sglang.decode_concurrency if routes else 0)
    if cfg.rollout.colocate:
        out.colocated = dict(servers[0].parts)
        out.released = out.colocated["runtime"]
        # each learner GPU receives every bucket (one broadcast) and flattens it into its server rank's payload
        # (training/sync.py, sglang_payloads.PayloadRelay), which the server rank opens by CUDA IPC, no copy of its own
        # sync_transport=reshard: this rank's pieces of a bucket and those gathered for its server rank are parts of
        # one bucket, and the packed copy is no larger than the latter (weight_sync/reshard.py, _local): 2 too
        out.gpu_sync = 2 * (cfg.rollout.sync_bucket_mb << 20)
    return out


def server_rows(cfg, hf, n_params: int, budget: int, largest_tensor: int, prompt_tokens: int) -> list[Row]:
    """One row per kind of server (they are alike): weights at its TP, the KV pool, the transients.
    largest_tensor: bytes of the largest HF tensor (bf16): the digest hook's unit of work."""
    sg = cfg.rollout.sglang
    tp = sg.tp_size
    servers = planned_servers(cfg)
    fraction = float(sg.server_args.get("mem_fraction_static", DEFAULT_MEM_FRACTION))
    shape = memory.Shape.of(hf, 1, 1)
    weights = 2 * n_params // tp  # bf16, every tensor split over the server's TP (vocabulary included)
    if cfg.rollout.weights == "fp8":  # block FP8 (moe/bridge/fp8.py): the selected weights' codes and scales
        fp8_total, bf16_total = served_bytes(hf)
        weights = fp8_total // tp
    kv_per_token = hf.num_hidden_layers * 2 * max(1, shape.kv_heads // tp) * shape.head_dim * 2
    # SGLang sizes the pool from the memory free when it starts: pre_model_load_memory (the MIN over its TP ranks,
    # sglang/srt/distributed/bootstrap.py:193-223) less what is resident after the weights load and the slack
    # pre x (1 - mem_fraction_static) (mem_cache/kv_cache_configurator.py:2990-3007): pool = fraction x free -
    # weights. Colocated, the servers start with the learner's state off the GPUs (training/colocate.HandOver.
    # before_launch), beside what a learner rank keeps there (its reserved share: CUDA context, NCCL)
    free = budget - (int(cfg.cluster.gpu_reserved_gb * GB) if cfg.rollout.colocate else 0)
    pool = max(0, int(fraction * free) - weights)
    # each driver spreads its share of the prompts over its share of the servers: the busiest server's load
    p = cfg.prompts
    in_flight = min(sg.max_in_flight_per_server, max(
        math.ceil(len(share_of(range(p.prompts_per_step), d, sg.drivers)) * p.n_samples
                  / len(share_of(range(servers), d, sg.drivers))) for d in range(sg.drivers)))
    row = Row("server GPU", f"{servers} x TP{tp}" + (" FP8" if cfg.rollout.weights == "fp8" else ""), budget)
    row.parts.update({
        "weights": weights, "KV pool": pool,
        # the sync receives one bucket of full HF tensors on every server rank; the digest hook
        # (launch/rlpo_sglang_hooks.py) gathers one tensor at a time: TP shards, their concatenation
        "sync bucket": cfg.rollout.sync_bucket_mb << 20, "digest": 2 * largest_tensor,
        "runtime": int(SGLANG_RUNTIME_GB * GB)})
    longest = prompt_tokens + response_budget(cfg)[0]  # a request at its longest (an episode's last turn)
    need = in_flight * longest
    if cfg.rollout.weights == "fp8":  # what FP8 frees for the KV pool, against the same server in bf16
        bf16_pool = max(0, int(fraction * free) - 2 * n_params // tp)
        row.info.update({"weights in bf16 (GB)": f"{2 * n_params // tp / GB:.1f}",
                         "KV tokens in bf16": bf16_pool // kv_per_token})
    row.info.update({"free at launch (GB)": f"{free / GB:.1f}", "KV tokens": pool // kv_per_token,
                     "tokens in flight (worst)": need,
                     "requests in flight": in_flight})
    if pool == 0:
        row.problem = (f"the weights ({weights / GB:.1f} GB at TP{tp}) leave no KV pool in mem_fraction_static="
                       f"{fraction} of the {free / GB:.1f} GB free at launch: raise rollout.sglang.tp_size")
    row.notes.append(f"mem_fraction_static={fraction}" + ("" if "mem_fraction_static" in sg.server_args else
                                                            " (assumed; the launch's SGLANG_ARGS set it)"))
    if need > pool // kv_per_token:
        row.notes.append(f"the requests in flight need {need} KV tokens at their longest, the pool holds "
                         f"{pool // kv_per_token}: SGLang queues or retracts the rest (slower, not an error)")
    if pool and not pool // kv_per_token >= longest:
        row.problem = (f"the KV pool ({pool // kv_per_token} tokens) cannot hold one request of "
                       f"{longest} tokens: raise rollout.sglang.tp_size")
    return [row]


def planned_servers(cfg) -> int:
    """The SGLang servers a plan sizes: the URLs given, the launched ones, or every GPU of cluster.rollout_nodes
    at the servers' TP; refused when there are none, or fewer than rollout drivers."""
    sg, c = cfg.rollout.sglang, cfg.cluster
    if sg.urls:
        servers, where = len(sg.urls), "in rollout.sglang.urls"
    elif sg.launch:
        servers, where = sg.num_servers, "launched (rollout.sglang.num_servers)"
    else:
        servers = c.rollout_nodes * c.gpus_per_node // sg.tp_size
        where = f"on cluster.rollout_nodes={c.rollout_nodes} x {c.gpus_per_node} GPUs at TP{sg.tp_size}"
    if servers < 1:
        raise PlanError("rollout.engine=sglang with no servers to plan: set cluster.rollout_nodes (the nodes the "
                        "SGLang servers run on), rollout.sglang.urls or rollout.sglang.launch + num_servers")
    if sg.drivers > servers:
        raise PlanError(f"rollout.sglang.drivers={sg.drivers} but the plan has {servers} SGLang server(s) {where}: "
                        f"each driver drives its own servers; set rollout.sglang.drivers <= {servers}")
    return servers
