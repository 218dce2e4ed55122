"""Megatron model + DDP + optimizer for one pipeline stage (the parallel wrapping, apart from model code)."""
from __future__ import annotations

import torch

from moe.bridge.megatron_io import load_hf_weights
from moe.families import get_family
from moe.lora import LoRASpec
from moe.lora import attach as attach_lora
from moe.model import build_gpt_model, transformer_config
from rlpo_mega import platform

PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_policy(hf, layout, model_cfg, optim_cfg=None, with_ddp: bool = True, routing_replay: bool = False,
                 value_head: bool = False, init_from_hf: str | None = None, head_seed: int = 0, seed: int = 0,
                 lora=None):
    """Returns (model_chunks, optimizer or None). model_chunks is a one-element list (no virtual PP).
    routing_replay: give the routers megatron's RouterReplay (moe.routing.replay drives it).
    value_head: the critic (moe.value_head, head drawn from head_seed); init_from_hf: its HF checkpoint
    (None: model_cfg.init_from_hf, the policy's). seed: the LoRA adapters' draws (model.lora; moe/lora.py). lora: the
    adapters of a critic (critic.lora; the policy's are model_cfg.lora)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if model_cfg.params_dtype not in PARAMS_DTYPES:
        raise ValueError(f"model.params_dtype={model_cfg.params_dtype!r}; choose one of {sorted(PARAMS_DTYPES)}")
    dtype = PARAMS_DTYPES[model_cfg.params_dtype]
    use_dist_opt = bool(optim_cfg and optim_cfg.use_distributed_optimizer)
    config = transformer_config(
        hf, layout.sizes(), params_dtype=dtype, token_dispatcher=model_cfg.token_dispatcher,
        recompute=model_cfg.recompute,
        # Per-token loss: finalize_model_grads divides by the GLOBAL token count (all micro-batches,
        # all DP ranks), so splitting a batch never changes the gradient.
        calculate_per_token_loss=True,
        moe_enable_routing_replay=routing_replay,
        **({"moe_router_bias_update_rate": model_cfg.expert_bias_update_rate}
           if get_family(hf.model_type).expert_bias(hf) else {}),
    )
    model = build_gpt_model(hf, config, vocab_divisible_by=model_cfg.vocab_divisible_by, value_head=value_head,
                            head_seed=head_seed)
    model.to(platform.device())
    source = init_from_hf or model_cfg.init_from_hf
    if source:
        # Before DDP and the optimizer: mixed-precision optimizers copy the weights at construction.
        model.loaded_whole = load_hf_weights([model], source, model_cfg.vocab_divisible_by)
    lora = model_cfg.lora if not value_head else lora
    if lora is not None and lora.rank:  # a critic without critic.lora trains whole
        # after the base weights, before DDP: DDP and the optimizer then hold the adapters' parameters only (and a
        # critic's value head)
        model.lora_counts = attach_lora(model, lora_spec(lora, seed))
    if not with_ddp:
        return [model], None
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config(use_dist_opt), module=model)
    ddp.hf_config = hf
    ddp.real_vocab_size = hf.vocab_size
    ddp.value_head = value_head
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    if optim_cfg is None:
        return [ddp], None
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        weight_decay=optim_cfg.weight_decay,
        adam_beta1=optim_cfg.adam_beta1,
        adam_beta2=optim_cfg.adam_beta2,
        adam_eps=optim_cfg.adam_eps,
        clip_grad=optim_cfg.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=use_dist_opt,
        optimizer_cpu_offload=optim_cfg.cpu_offload,
        # core's default fraction is 0.0 (nothing offloaded); the config's only applies with cpu_offload
        optimizer_offload_fraction=optim_cfg.offload_fraction if optim_cfg.cpu_offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=optim_cfg.overlap_cpu_optimizer_d2h_h2d,
        use_precision_aware_optimizer=optim_cfg.precision_aware,
        exp_avg_dtype=MOMENT_DTYPES[optim_cfg.exp_avg_dtype],
        exp_avg_sq_dtype=MOMENT_DTYPES[optim_cfg.exp_avg_sq_dtype],
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    config.grad_scale_func = optimizer.scale_loss
    return [ddp], optimizer


def lora_setting(lora_cfg) -> dict | None:
    """model.lora as a checkpoint records it (None: no adapters): what a resume must match and an export rebuild."""
    if not lora_cfg.rank:
        return None
    return {"rank": lora_cfg.rank, "alpha": lora_cfg.alpha, "targets": list(lora_cfg.targets),
            "expert_layout": lora_cfg.expert_layout}


def lora_spec(lora_cfg, seed: int = 0) -> LoRASpec:
    return LoRASpec(rank=lora_cfg.rank, alpha=lora_cfg.alpha, targets=tuple(lora_cfg.targets),
                    expert_layout=lora_cfg.expert_layout, seed=seed)


def ddp_config(use_distributed_optimizer: bool):
    """The DDP settings of every model (rlpo_mega.planning sizes the buffers they give).

    On CUDA the gradient reduction overlaps the backward: each bucket (megatron's default size under overlap,
    max(40M, 1M x DP) elements) is reduced as soon as its last gradient is ready. Not on a CPU: gloo's
    asynchronous collectives would compete for the few cores with the backward itself. overlap_param_gather
    stays off: it defers the distributed optimizer's all-gather of the updated parameters to the next
    forward's pre-hooks, but an RL step reads them right after the optimizer step (the weight sync to the
    rollout engine, checkpoints), so it would hand the engine the previous step's weights."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=torch.cuda.is_available(),
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,
    )


def unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


def optimizer_steps(cfg) -> int:
    """Optimizer steps of a whole run: one per mini-batch and epoch of every RL step."""
    return cfg.train_iters * cfg.trainer.mini_batches * cfg.trainer.epochs


def build_lr_scheduler(optimizer, optim_cfg, total_steps: int):
    """megatron-core's OptimizerParamScheduler over optimizer steps (it sets every param group's lr and,
    with wd_mult, weight decay). `total_steps` is the run's optimizer steps, the default decay length."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = optim_cfg.lr_decay_steps or total_steps
    return OptimizerParamScheduler(
        optimizer, init_lr=optim_cfg.lr_warmup_init, max_lr=optim_cfg.lr, min_lr=optim_cfg.min_lr,
        # megatron asserts warm-up < decay even for the constant style, which never decays
        lr_warmup_steps=optim_cfg.lr_warmup_steps, lr_decay_steps=max(decay, optim_cfg.lr_warmup_steps + 1),
        lr_decay_style=optim_cfg.lr_decay_style, start_wd=optim_cfg.weight_decay, end_wd=optim_cfg.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant")
