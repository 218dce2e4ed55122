"""Runs inside an SGLang server (registered with --custom-weight-loader; the repository root and launch/ are
on its PYTHONPATH: launch/sglang_server.py sets both).

`report_digests` is how the learner verifies a weight sync: SGLang offers no way to read Qwen3-MoE/Mixtral
weights back over HTTP (get_weights_by_name covers a few dense models), and shipping every weight back (or
dumping it to a directory the learner may not see: a server on another node) at every sync is out of the
question. So the digests are computed here, where the weights live, and only the digests travel back:

  the learner calls update_weights_from_tensor(load_format="rlpo_sglang_hooks.report_digests") with one
  dummy tensor whose *name* is a JSON request {"store": [host, port], "key": ..., "algorithm": ...};
  every TP rank of the server runs this function: the TP shards are gathered to TP rank 0 over SGLang's own
  TP group (on the GPU, over NVLink) one parameter (or one expert) at a time, unfused into HF names
  (moe/families/sglang_names.py) and digested with the learner's algorithm (moe/bridge/digest.py) before the
  next gather, and TP rank 0 writes {"digests": {...}, "peak_extra_bytes": ...} (or {"error": ...}) under
  `key` into the learner's TCP store, sealed with the job's key (rlpo_sglang_keys.seal: an HMAC the learner checks,
  since that store takes writes from anyone who reaches it; the key is the server's own --api-key).

The TP layout read here is SGLang's (its linear-layer classes decide how each parameter is split); the
model-family names are the family's. Imports torch, the two modules above, SGLang and rlpo_sglang_keys (beside
this file): nothing else.
"""
import json
import os
from datetime import timedelta

import torch

REPORT_LOADER = "rlpo_sglang_hooks.report_digests"
# moe/bridge/fp8.py's SCALE_SUFFIX and BLOCK, restated: this module imports moe.* only inside its functions (sglang
# imports it at its start); tests/test_fp8.py checks that the two agree
FP8_SCALE, FP8_BLOCK = "_scale_inv", 128


def _tp_group():
    from sglang.srt.distributed.parallel_state import get_tp_group

    return get_tp_group()


def _components(module, name: str, tp: int):
    """Row counts (dim 0, or dim 1 of fused experts) of the fused parts of one TP-local shard, or None when
    the shard is one piece. Rank r's shard is [part_0 of rank r; part_1 of rank r; ...]."""
    kind = type(module).__name__
    # a block-FP8 weight's scales (rollout.weights=fp8): one row per 128 of its weight's rows
    rows = (lambda n: n // FP8_BLOCK) if name.endswith(FP8_SCALE) else (lambda n: n)
    if kind == "QKVParallelLinear" and name.endswith(("weight", "bias", FP8_SCALE)):
        return [rows(module.num_heads * module.head_size), rows(module.num_kv_heads * module.head_size),
                rows(module.num_kv_heads * module.v_head_size)]
    if kind == "MergedColumnParallelLinear" and name.endswith(("weight", "bias", FP8_SCALE)):
        return [rows(s // tp) for s in module.output_sizes]
    return None


def _split_dim(module, name: str) -> int | None:
    """The dimension SGLang splits over TP for this parameter (None: replicated)."""
    kind = type(module).__name__
    leaf = name.rsplit(".", 1)[-1].removesuffix(FP8_SCALE)  # a weight's block-FP8 scales split as it does
    if leaf in ("w13_weight", "w2_weight"):  # fused experts: split by SGLang's MoE layout, not the TP layout
        moe_tp, moe_ep = getattr(module, "moe_tp_size", 1), getattr(module, "moe_ep_size", 1)
        if moe_tp > 1 and moe_ep > 1:
            raise NotImplementedError(f"{name}: experts split over both MoE-TP ({moe_tp}) and EP ({moe_ep})")
        if moe_ep > 1:
            return 0  # whole experts per rank, in rank order
        if moe_tp > 1:
            return 1 if leaf == "w13_weight" else 2  # the intermediate dimension
        return None  # every rank holds every expert whole (e.g. SGLang's CPU MoE)
    # a parallel linear built whole on every rank (SGLang replicates e.g. glm4_moe's shared experts in some
    # set-ups) holds its full size: nothing to gather
    if getattr(module, "output_size_per_partition", None) == getattr(module, "output_size", -1) \
            and kind != "RowParallelLinear":
        return None
    if getattr(module, "input_size_per_partition", None) == getattr(module, "input_size", -1) \
            and kind == "RowParallelLinear":
        return None
    if kind in ("QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear",
                "VocabParallelEmbedding", "ParallelLMHead"):
        return 0
    if kind == "RowParallelLinear":
        return 1 if leaf == "weight" else None
    return None


def _model_intermediate(config) -> int:
    """The checkpoint's expert intermediate size (SGLang's CPU path overwrites the config's with a padded one)."""
    attr = "moe_intermediate_size" if getattr(config, "moe_intermediate_size", None) else "intermediate_size"
    return int(getattr(config, "original_" + attr, None) or getattr(config, attr))


def _unshard(module, name: str, shards: list, tp: int, config) -> torch.Tensor:
    """TP-local shards (rank order) -> SGLang's TP-1 tensor of that parameter."""
    dim = _split_dim(module, name)
    scales = name.endswith(FP8_SCALE)
    leaf = name.rsplit(".", 1)[-1].removesuffix(FP8_SCALE)
    if leaf in ("w13_weight", "w2_weight"):
        # rank r holds intermediate rows [r*P, (r+1)*P) of the *padded* size (on its CPU path SGLang pads
        # moe_intermediate_size to a multiple of tp*its kernel's block and keeps the model's value as
        # original_<attr>; the rows past it are zeros): concatenate the ranks' parts, keep the model's rows
        if dim is None:
            shards = shards[:1]
        elif dim == 0:
            shards = [torch.cat(shards, 0)]
        real = _model_intermediate(config)
        if scales:  # block-FP8 scales: the model's intermediate size in 128-blocks
            real = -(-real // FP8_BLOCK)
        if leaf == "w2_weight":
            return torch.cat(shards, 2)[..., :real]
        parts = [s.chunk(2, dim=1) for s in shards]  # per expert [gate_r; up_r]
        return torch.cat([torch.cat([p[0] for p in parts], 1)[:, :real],
                          torch.cat([p[1] for p in parts], 1)[:, :real]], 1)
    if dim is None:
        return shards[0]
    sizes = _components(module, name, tp)
    if sizes is None:
        return torch.cat(shards, dim)
    split = [s.split(sizes, dim=0) for s in shards]
    out = []
    for j in range(len(sizes)):
        ranks = range(tp)
        if type(module).__name__ == "QKVParallelLinear" and j > 0 and module.num_kv_head_replicas > 1:
            ranks = range(0, tp, module.num_kv_head_replicas)  # kv heads replicated over TP ranks: one each
        out.append(torch.cat([split[r][j] for r in ranks], 0))
    return torch.cat(out, 0)


def _gathered(group, t: torch.Tensor):
    """[tp, *t.shape] on TP rank 0 (None elsewhere): SGLang's gather over its TP group. Block-FP8 codes
    (rollout.weights=fp8) travel as their bytes: gloo refuses float8 ("Invalid scalar type")."""
    if t.dtype == torch.float8_e4m3fn:
        out = group.gather(t.view(torch.uint8).unsqueeze(0).contiguous(), dst=0, dim=0)
        return None if out is None else out.view(torch.float8_e4m3fn)
    return group.gather(t.unsqueeze(0).contiguous(), dst=0, dim=0)


def hf_tensors(model, group=None):
    """Yields (sglang name, SGLang's TP-1 tensor) on TP rank 0, one parameter at a time -- a fused expert
    parameter one expert at a time, as (name, first expert, tensor of that expert [1, ...]) -- and
    nothing on the other ranks, which take part in the same gathers. Collective over the server's TP ranks.
    What is held at once is one parameter's (or expert slice's) shards and their concatenation: the largest
    tensor bounds the extra memory, not the model (the whole TP-1 model would not fit next to the weights and
    the KV pool of a GPU)."""
    group = group or _tp_group()
    tp, rank = group.world_size, group.rank_in_group
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        owner = modules.get(name.rsplit(".", 1)[0]) if "." in name else model
        dim = _split_dim(owner, name) if tp > 1 else None
        t = p.detach()
        if name.endswith(("w13_weight", "w2_weight", "w13_weight" + FP8_SCALE, "w2_weight" + FP8_SCALE)):
            local = t.shape[0]
            for e0 in range(local):
                part = t[e0:e0 + 1]
                if dim is None:  # whole on every rank (maybe padded): no gather
                    if rank == 0:
                        yield name, e0, _unshard(owner, name, [part], tp, model.config)
                    continue
                stacked = _gathered(group, part)
                if rank == 0:
                    if dim == 0:  # whole experts per rank: rank r's slice holds experts r * local + e0 ...
                        for r in range(tp):
                            yield name, r * local + e0, _unshard(owner, name, [stacked[r]], 1, model.config)
                    else:
                        yield name, e0, _unshard(owner, name, list(stacked.unbind(0)), tp, model.config)
                del stacked
            continue
        stacked = None if dim is None else _gathered(group, t)
        if rank == 0:
            full = t if dim is None else _unshard(owner, name, list(stacked.unbind(0)), tp, model.config)
            if ".shared_experts." in name:
                full = _unpad_shared_expert(name, full, model.config)
            yield name, None, full
        del stacked


def _unpad_shared_expert(name: str, t: torch.Tensor, config) -> torch.Tensor:
    """A shared expert MLP is built with the padded intermediate size too (on SGLang's CPU path, with the
    experts'; zero rows past the model's): keep the checkpoint's rows (gate_up: each half) or columns (down)."""
    real = _model_intermediate(config) * int(getattr(config, "n_shared_experts", 1) or 1)
    if name.endswith("gate_up_proj.weight") and t.shape[0] > 2 * real:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate[:real], up[:real]], 0)
    if name.endswith("down_proj.weight") and t.shape[1] > real:
        return t[:, :real]
    return t


def _fp8_part(name: str, t: torch.Tensor) -> bool:
    """A block-FP8 weight's codes or scales (rollout.weights=fp8): digested as held, never cast."""
    return t.dtype == torch.float8_e4m3fn or name.endswith(FP8_SCALE)


def _serving_dtype(model) -> torch.dtype:
    """The dtype SGLang serves in (its --dtype): the embedding's. Some tensors are held wider (sigmoid routers'
    gate weights in fp32); the learner sends them in this dtype and the upcast is exact, so they are digested
    back in it. Tensors every side keeps in fp32 (the family's fp32_hf_tensor: the score-correction bias) are
    sent and digested as such."""
    from moe.families import get_family

    embedding = get_family(model.config.model_type).hf_names(model.config)["embedding"]
    params = dict(model.named_parameters())
    if embedding in params:
        return params[embedding].dtype
    return next(p.dtype for p in params.values() if p.is_floating_point())


def digests_of(model, algorithm: str, group=None):
    """{HF name: digest} of what this server holds (TP rank 0; None on the others), digested as gathered."""
    from moe.bridge.digest import tensor_digests
    from moe.families import get_family
    from moe.families.sglang_names import sglang_to_hf

    group = group or _tp_group()
    dtype = _serving_dtype(model)
    family = get_family(model.config.model_type)
    out = {} if group.rank_in_group == 0 else None
    for name, first, t in hf_tensors(model, group):
        if first is not None:  # experts [first, first + n) of a fused expert parameter: named one by one
            views = sglang_to_hf({name: t}, model.config, first_expert=first, tie=False)
        else:
            views = sglang_to_hf({name: t}, model.config, tie=False)
        if out is not None:  # one host copy per gathered parameter (a fused expert weight: all its experts)
            cast = [v.to(dtype) if v.is_floating_point() and v.dtype != dtype and not family.fp32_hf_tensor(
                model.config, n) and not _fp8_part(n, v) else v for n, v in views.items()]
            out.update(zip(views, tensor_digests(cast, algorithm)))
        del t, views
    if out is not None:
        names = family.hf_names(model.config)
        if names["output"] not in out and getattr(model.config, "tie_word_embeddings", False):
            out[names["output"]] = out[names["embedding"]]
    return out


def _rss() -> tuple[int, int]:
    """(resident bytes now, the peak since the last reset) of this process; (0, 0) where /proc cannot tell."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10
    except (OSError, KeyError, ValueError):
        return 0, 0


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: resets VmHWM to the current RSS
    except OSError:  # not Linux: the reported peak is then the process's lifetime peak, an over-estimate
        pass


def environment() -> dict:
    """What the learner checks before it joins this server in a weight-update group (versions that must match)."""
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": list(nccl) if nccl else None}


def job_key():
    """The key this server was started with (its --api-key, which rlpo_sglang_keys sets from $RLPO_SGLANG_KEY: the
    job's key, the one the learner's requests carry); None for a server without one."""
    try:
        from sglang.srt.runtime_context import get_server_args

        key = getattr(get_server_args(), "api_key", None)
    except Exception:  # another SGLang layout: the shim's variable (set in the server's environment)
        key = None
    import rlpo_sglang_keys

    return key or os.environ.get(rlpo_sglang_keys.KEY_ENV) or None


# ---- the shard-to-shard refit (rollout.sync_transport=reshard; rlpo_mega/weight_sync/reshard.py) ----------------
_GROUPS: dict = {}  # group name -> this TP rank's process group with the learner ranks (and the other servers' ranks)
_PLANS: dict = {}  # the request's layouts -> (plan, {name: TensorSpec}, buckets): planned once per layout


def _reshard_join(req, group) -> dict:
    """Join the refit group: the learner ranks are its ranks 0..L-1, each server's TP ranks follow at their offset.
    SGLang's own group constructor (sglang/srt/utils/common.py init_custom_process_group, what its
    init_weights_update_group uses: a TCP store client at the learner's rendezvous, the group name as its prefix)."""
    from sglang.srt.utils.common import init_custom_process_group

    host, port = req["rendezvous"]
    rank = int(req["rank_offset"]) + group.rank_in_group
    world = int(req["world_size"])
    pg = init_custom_process_group(backend=req["backend"], init_method=f"tcp://{host}:{port}", world_size=world,
                                   rank=rank, group_name=req["group"],
                                   timeout=timedelta(seconds=float(req.get("timeout", 300))))
    from torch.distributed.distributed_c10d import _world

    _world.pg_group_ranks[pg] = {i: i for i in range(world)}  # group ranks are the ranks the plan names
    _GROUPS[req["group"]] = pg
    return {"joined": rank}


def _reshard_leave(req) -> dict:
    pg = _GROUPS.pop(req["group"], None)
    if pg is not None:
        torch.distributed.destroy_process_group(pg)
    return {"left": pg is not None}


def _reshard_plan(config, req, device: str):
    """The learner's plan, made here from the same pure function and the same inputs (moe/bridge/reshard.py); the
    request's count and bytes must match it, or the two sides read different models."""
    from moe.bridge import reshard as rs
    from moe.bridge.mapping import param_maps

    fp8 = bool(req.get("fp8"))  # rollout.weights=fp8: the FP8 weights' codes and scales (moe/bridge/reshard.py)
    key = (id(config),  # (a server has one; a test may ask with another)
           json.dumps([req["learner"], req["servers"], req["dtype"], fp8, req["bucket_bytes"]], sort_keys=True))
    if key not in _PLANS:
        model = rs.ModelSpec.of(config, getattr(torch, req["dtype"]), fp8=fp8)
        learner = rs.LearnerLayout(**{k: (frozenset(v) if k == "whole_on_tp" else v) for k, v in req["learner"].items()})
        plan = rs.reshard_plan(model, learner, [rs.ServerLayout(*s) for s in req["servers"]])
        joined = frozenset(n for pm in param_maps(config) if pm.with_previous for n in pm.hf)
        _PLANS[key] = (plan, {t.name: t for t in model.tensors}, rs.plan_buckets(plan, int(req["bucket_bytes"]), joined))
    plan, specs, buckets = _PLANS[key]
    mine = [len(plan.transfers), sum(t.nbytes for t in plan.transfers)]
    if mine != list(req["check"]):
        # SGLang's CPU path rewrites the served config (configs/update_config.py,
        # adjust_config_with_unaligned_cpu_tp: an intermediate size padded to a multiple of TP x 32), which the
        # plan -- made for GPU servers -- does not model: on a CPU server that is the likelier cause
        tp = max(s[0] for s in req["servers"])
        cpu = (f"; or, on this CPU server, SGLang padded an intermediate size that is no multiple of TP x 32 = "
               f"{tp * 32} (the plan models GPU servers: use such a size, or rollout.sync_transport="
               "sglang_distributed)") if device == "cpu" else ""
        raise ValueError(f"the refit plan made in this server ({mine[0]} transfers, {mine[1]} bytes) is not the "
                         f"learner's ({req['check'][0]}, {req['check'][1]}): its checkpoint's config.json differs from "
                         f"the learner's model.hf_config{cpu}")
    return plan, specs, buckets


def _reshard_sync(model, req, group) -> dict:
    """Receive this TP rank's pieces of every tensor from the learner ranks that hold them, bucket by bucket (the
    plan's order on both sides), load each tensor's region through the receiver (rlpo_sglang_receiver.load_regions)
    and digest each piece as read back from the parameters it went into."""
    pg = _GROUPS.get(req["group"])
    if pg is None:
        raise RuntimeError(f"no refit group {req['group']!r} on this server (restarted since the learner made it?)")
    plan, specs, buckets = _reshard_plan(model.config, req, next(model.parameters()).device.type)
    index, tp_rank = int(req["index"]), group.rank_in_group

    def receive(into):
        # irecvs in plan order: each sender's isends are in the same order (no cycle between ranks); block-FP8
        # codes arrive as their bytes (the sender's _wire: gloo refuses float8)
        for w in [torch.distributed.irecv(target.view(torch.uint8) if target.dtype == torch.float8_e4m3fn else target,
                                          src=t.src, group=pg) for t, target in into]:
            w.wait()

    result = {"digests": {}, "as_received": 0, "bytes": 0, "receiver": {}}
    for start, stop in buckets:
        mine = [t for t in plan.transfers[start:stop] if t.server == index and t.rank == tp_rank]
        if mine:
            _load_pieces(model, plan, specs, index, tp_rank, mine, receive, req["algorithm"], result)
    return result


def _reshard_local(model, req, group) -> dict:
    """rollout.colocate: this TP rank's pieces of one bucket, packed into one byte tensor (moe/bridge/reshard.
    packed_offsets) on this rank's own GPU by the learner rank there, after the learner ranks exchanged them
    (rlpo_mega/weight_sync/reshard.py); opened by its CUDA IPC handle (on a CPU, a shared-memory file), unpacked,
    loaded region by region through the receiver and digested as read back."""
    from moe.bridge import reshard as rs
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    plan, specs, buckets = _reshard_plan(model.config, req, next(model.parameters()).device.type)
    index, tp_rank = int(req["index"]), group.rank_in_group
    start, stop = buckets[int(req["bucket"])]
    mine = [t for t in plan.transfers[start:stop] if t.server == index and t.rank == tp_rank]
    result = {"digests": {}, "as_received": 0, "bytes": 0, "receiver": {}}
    if not mine:
        if req.get("entry"):
            raise ValueError(f"a packed bucket for TP rank {tp_rank}, which the plan gives nothing of bucket "
                             f"{req['bucket']}")
        return result
    monkey_patch_torch_reductions()  # (SGLang's TP worker has: a CUDA handle names its GPU by UUID)
    flat = MultiprocessingSerializer.deserialize(req["entry"])
    try:
        views = rs.unpack(flat, mine, [specs[t.name].dtype for t in mine])
    except ValueError as e:
        raise ValueError(f"bucket {req['bucket']}, TP rank {tp_rank}: {e}") from None

    def unpack(into):
        for (t, target), view in zip(into, views):
            target.copy_(view)

    _load_pieces(model, plan, specs, index, tp_rank, mine, unpack, req["algorithm"], result)
    del flat, views  # its handle closed here: the producer's memory can go once every rank has loaded
    return result


def _load_pieces(model, plan, specs, index: int, tp_rank: int, mine: list, fill, algorithm: str, result: dict):
    """One bucket's pieces of this TP rank (`mine`, in plan order) into their tensors' regions: `fill([(transfer,
    contiguous target)])` writes each piece, the regions are loaded through the receiver and each piece is digested
    as read back from the parameters (as received where SGLang loads the name itself). Adds to `result`."""
    import rlpo_sglang_receiver
    from moe.bridge import reshard as rs
    from moe.bridge.digest import tensor_digests

    layout = plan.servers[index]
    receiver = rlpo_sglang_receiver.install(model)
    device = next(model.parameters()).device
    regions, into, scattered = {}, [], []
    for t in mine:
        if t.name not in regions:
            box = rs.server_region(specs[t.name], plan.model, layout, tp_rank)
            regions[t.name] = (box, torch.empty([b - a for a, b in box], dtype=specs[t.name].dtype, device=device))
        view = regions[t.name][1][tuple(slice(a, b) for a, b in t.dst_box)]
        target = view if view.is_contiguous() else torch.empty(view.shape, dtype=view.dtype, device=device)
        if target is not view:
            scattered.append((view, target))
        into.append((t, target))
        result["bytes"] += t.nbytes
    fill(into)
    for view, target in scattered:
        view.copy_(target)
    receiver.load_regions([(n, specs[n].shape, box, buf) for n, (box, buf) in regions.items()])
    pieces = []
    for t in mine:
        box, buf = regions[t.name]
        back = receiver.read_region(t.name, box, torch.empty_like(buf))
        if back is None:  # SGLang loads it (its own layout): digested as received
            back = buf
            result["as_received"] += 1
        pieces.append(back[tuple(slice(a, b) for a, b in t.dst_box)].contiguous())
    result["digests"].update(zip((rs.piece_key(t) for t in mine), tensor_digests(pieces, algorithm)))
    result["receiver"] = dict(receiver.stats)


def _report(req, result, rank=None):
    """`result` into the learner's TCP store under the request's key (a TP rank's own: key/rank), sealed."""
    import rlpo_sglang_keys

    host, port = req["store"]
    store = torch.distributed.TCPStore(host, int(port), is_master=False,
                                       timeout=timedelta(seconds=float(req.get("timeout", 300))))
    key = req["key"] if rank is None else f"{req['key']}/{rank}"
    store.set(key, rlpo_sglang_keys.seal(job_key(), key, result))


def report_digests(model, named_tensors):
    """The loader the learner calls: {"what": "environment"} reports environment(), {"what": "receiver"} installs
    the O(1) receiver (rlpo_sglang_receiver) and reports its counts (TP rank 0's), anything else the weight
    digests (digests_of) with their peak extra memory."""
    req = json.loads(named_tensors[0][0])
    group = _tp_group()
    import rlpo_sglang_receiver

    # the O(1) receiver on this rank from the first report on (the digest check after a server's first sync, its
    # environment before a weight-update group): every later sync, by any transport, loads through it
    rlpo_sglang_receiver.install(model)
    refit = {"reshard_join": lambda: _reshard_join(req, group), "reshard_sync": lambda: _reshard_sync(model, req, group),
             "reshard_local": lambda: _reshard_local(model, req, group), "reshard_leave": lambda: _reshard_leave(req)}
    if req.get("what") in refit:  # every TP rank reports its own
        try:
            result = refit[req["what"]]()
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"}
            raise
        finally:
            _report(req, result, group.rank_in_group)
        return
    try:
        if req.get("what") == "environment":
            result = {"environment": environment()}
            return
        if req.get("what") == "receiver":  # installed on this rank (once); its counts so far
            result = {"receiver": dict(rlpo_sglang_receiver.install(model, req.get("replay")).stats)}
            return
        _reset_peak()
        before, _ = _rss()
        result = {"digests": digests_of(model, req["algorithm"], group)}
        _, peak = _rss()
        # host memory (this process's RSS) added at the peak: what the digests cost a CPU server; on GPUs the
        # gathers live in device memory, bounded by the same largest tensor (tests/test_recipes.py)
        result["peak_extra_bytes"] = max(0, peak - before)
    except Exception as e:  # reported to the learner, which stops with it; raised here for the server log
        result = {"error": f"{type(e).__name__}: {e}"}
        raise
    finally:
        if group.rank_in_group == 0:
            _report(req, result)
