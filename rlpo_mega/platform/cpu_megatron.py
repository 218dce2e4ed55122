"""Run-time patches that let megatron-core 0.16.1 train on a CPU with gloo.

megatron-core has no CPU mode: it calls CUDA streams, CUDA RNG, `device="cuda"` factories and
gloo-incompatible collectives on paths every training step takes. Each patch below names the
megatron-core file:line it answers (numbers of the 0.16.1 wheel). They are applied only when CUDA is
absent (see `rlpo_mega.platform.apply`): on a GPU run none of this code executes. What the local
(no Transformer Engine) layer spec needs on any device, GPU included, is in megatron_fixes.py.

Every patch has an ablation test (tests/test_platform.py) that runs the failing megatron path with all
patches but that one and checks it breaks.
"""
from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

WRITTEN_FOR = "0.16.1"


@dataclass(frozen=True)
class Patch:
    name: str
    answers: tuple[str, ...]  # megatron-core file:line (0.16.1) that fails without it
    why: str
    apply: Callable[[], None] = field(repr=False)


class _ModuleProxy(types.ModuleType):
    """Stands in for `torch` (or `torch.distributed`) inside one megatron module only.

    Attributes listed in `overrides` are replaced; everything else is the real module, so the
    patch is scoped to the megatron file it answers instead of changing torch for everyone.
    """

    def __init__(self, real: types.ModuleType, overrides: dict):
        super().__init__(real.__name__)
        self._real = real
        self._overrides = overrides

    def __getattr__(self, name):
        overrides = self.__dict__["_overrides"]
        if name in overrides:
            return overrides[name]
        return getattr(self.__dict__["_real"], name)


def _torch_proxy_for(module) -> _ModuleProxy:
    """The (shared) torch proxy installed in `module`; created on first use."""
    current = module.torch
    if isinstance(current, _ModuleProxy):
        return current
    proxy = _ModuleProxy(torch, {})
    module.torch = proxy
    return proxy


# ---------------------------------------------------------------------------------------------
# 1. torch.cuda.current_device() used as a device on CPU paths.
def _patch_current_device():
    # An int device id means cuda:<id>; returning the CPU device makes every
    # `device=torch.cuda.current_device()` factory (and GlobalMemoryBuffer, RoPE's inv_freq move,
    # p2p shape tensors, DDP grad buffers, checkpoint failure flags) allocate on the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")


# 2. CUDA streams and events used for overlap and host copies.
class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return _NullEvent()

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_streams():
    # On CPU every op is synchronous, so a stream that orders nothing is exact.
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.default_stream = lambda device=None: _NullStream()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.Tensor.record_stream = lambda self, stream: None


# 3. The CUDA RNG tracker.
def _patch_rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """The tracker's named states are CPU generator states; fork swaps the default generator.

        Same contract as CudaRNGStatesTracker: tensor-parallel ranks get distinct streams for
        dropout/init inside `fork()`, and the default stream is restored afterwards.
        """

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    # initialize_rng_tracker (random.py:286) instantiates the module-global class by name.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.CpuRNGStatesTracker = CpuRNGStatesTracker
    # model_parallel_cuda_manual_seed (random.py:422) seeds the default stream via torch.cuda.
    proxy = _torch_proxy_for(mrandom)
    proxy._overrides["cuda"] = _ModuleProxy(torch.cuda, {"manual_seed": torch.manual_seed})
    mrandom.initialize_rng_tracker(force_reset=True)
    # Activation recompute (CheckpointFunction, random.py:444-458) saves/restores the CUDA generator next
    # to the CPU one and the tracker's; on CPU there is none (the CPU state is saved separately there).
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


# 5. alltoall split sizes.
def _patch_all_to_all_splits():
    from megatron.core.tensor_parallel import mappings

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        # The token dispatcher passes split sizes as tensors; gloo only takes lists of ints.
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, **kw)

    _distributed_overrides(mappings)["all_to_all_single"] = all_to_all_single


def _distributed_overrides(module) -> dict:
    proxy = _torch_proxy_for(module)
    sub = proxy._overrides.get("distributed")
    if sub is None:
        sub = proxy._overrides["distributed"] = _ModuleProxy(dist, {})
    return sub._overrides


# 6. (WrappedTorchNorm and sequence parallelism: not CPU-specific, in megatron_fixes.py.)


# 7. Literal device="cuda" tensor factories.
def _cpu_factory(fn):
    def factory(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return factory


_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")


def _patch_cuda_literals():
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core import utils as core_utils
    from megatron.core.transformer import utils as transformer_utils

    for module in (schedules, optimizer, clip_grads, transformer_utils, core_utils):
        proxy = _torch_proxy_for(module)
        for name in _FACTORIES:
            proxy._overrides[name] = _cpu_factory(getattr(torch, name))


# 8. clip_grad_by_total_norm_fp32 asserts CUDA tensors.
def _patch_clip_grads():
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        # Same semantics as clip_grads.py:143 without the `torch.cuda.FloatTensor` type assert.
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


# 9. Uneven all-gather: gloo needs equal sizes.
def _patch_uneven_all_gather():
    from megatron.core.tensor_parallel import mappings

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        # The alltoall dispatcher gathers each expert-TP rank's tokens (token_dispatcher.py:696);
        # with EP > 1 their counts differ, and ProcessGroupGloo::allgather rejects unequal sizes.
        sizes = [t.shape[0] for t in tensor_list]
        if len(set(sizes)) == 1:
            return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        assert not async_op, "uneven all_gather is synchronous on CPU"
        # Pad to the largest shard, gather, then copy the valid rows out.
        longest = max(sizes)
        padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded, group=group)
        for out, got, n in zip(tensor_list, gathered, sizes):
            out.copy_(got[:n])
        # (The matching uneven reduce_scatter, mappings.py:193, is supported by gloo as of torch 2.13.)

    _distributed_overrides(mappings)["all_gather"] = all_gather


# 10. Tied embeddings under pipeline parallelism move the shared weight with Tensor.cuda().
def _patch_tied_embedding_cuda():
    from megatron.core.models.common.language_module import language_module

    cls = language_module.LanguageModule
    original = cls.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self):
        # The first/last-stage all-reduce of the shared weight is right on CPU; only the .cuda()
        # move before it is not. Make it a no-op for the duration of this method only.
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = saved

    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


# 10b. Context parallelism's RoPE table per CP rank (multi-latent attention's YaRN cache, built at construction).
def _patch_cp_pos_emb_cuda():
    from megatron.core.models.common.embeddings import rope_utils, yarn_rotary_pos_embedding

    original = rope_utils.get_pos_emb_on_this_cp_rank
    if getattr(original, "_rlpo_cpu", False):
        return
    # its chunk ids are a pinned host tensor moved with .cuda(): neither exists on a CPU build
    _torch_proxy_for(rope_utils)._overrides["tensor"] = _cpu_factory(torch.tensor)

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t
        try:
            return original(pos_emb, seq_dim, cp_group)
        finally:
            torch.Tensor.cuda = saved

    get_pos_emb_on_this_cp_rank._rlpo_cpu = True
    rope_utils.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank  # imported by name there


# 11. The mixed-precision and distributed optimizers sort parameters by CUDA tensor type names.
_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _patch_optimizer_param_types():
    from megatron.core.optimizer import distrib_optimizer, optimizer

    def with_cuda_type_names(init):
        @functools.wraps(init)  # __wrapped__: the ablation test builds with the original
        def __init__(self, *args, **kwargs):
            # Both constructors tell fp32 from 16-bit params by `param.type()` compared with
            # 'torch.cuda.*Tensor' and raise TypeError for anything else; a CPU param's name lacks
            # '.cuda'. For the constructor only, the argument-less form (a name, never a cast) answers
            # with the CUDA name of the same dtype, so the same params get the same fp32 main copies.
            saved = torch.Tensor.type

            def type_(t, dtype=None, non_blocking=False, **kw):
                if dtype is None and not kw:
                    name = saved(t)
                    return _CUDA_TYPE_NAMES.get(name, name)
                return saved(t, dtype, non_blocking, **kw)

            torch.Tensor.type = type_
            try:
                return init(self, *args, **kwargs)
            finally:
                torch.Tensor.type = saved

        return __init__

    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls.__init__ = with_cuda_type_names(cls.__init__)


# 12. The HybridDeviceOptimizer (optimizer CPU offload) tells device params from host copies by `is_cuda`.
HOST_MARK = "_rlpo_host"  # on a tensor that a CUDA run holds in host memory (HDO's offloaded copies)


def on_host(t: torch.Tensor) -> bool:
    """Whether a CUDA run would hold `t` in host memory: on CPU, a tensor the HybridDeviceOptimizer offloaded
    (its fp32 master and, through its state, the Adam moments). Used to count the accelerator's bytes."""
    return getattr(t, HOST_MARK, False)


@contextlib.contextmanager
def _host_copies_marked():
    # On CPU every tensor answers is_cuda=False, so HDO (hybrid_optimizer.py:256,273,285) would take every
    # param for a host one: nothing offloaded, every param in its CPU optimizer, and the copy-back hook's
    # lookup (:101) failing. Here a tensor is on the accelerator unless it descends from a `.pin_memory()`
    # host copy (:274): pinning marks it (CPU torch has no pinned allocator; on CPU every page is alike), and
    # detach/clone/float of a marked tensor stay marked (:278), so the placement is megatron's own.
    saved = {name: getattr(torch.Tensor, name) for name in ("detach", "clone", "float")}

    def inherit(name):
        def method(t, *args, **kwargs):
            out = saved[name](t, *args, **kwargs)
            if on_host(t):
                setattr(out, HOST_MARK, True)
            return out
        return method

    def pin_memory(t, *args, **kwargs):
        setattr(t, HOST_MARK, True)
        return t

    torch.Tensor.is_cuda = property(lambda t: not on_host(t))
    torch.Tensor.pin_memory = pin_memory
    for name in saved:
        setattr(torch.Tensor, name, inherit(name))
    try:
        yield
    finally:
        del torch.Tensor.is_cuda, torch.Tensor.pin_memory
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _patch_hybrid_optimizer():
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as hdo

    cls = hdo.HybridDeviceOptimizer
    placement = cls._get_sub_optimizer_param_groups

    @functools.wraps(placement)
    def _get_sub_optimizer_param_groups(self, offload_fraction):
        with _host_copies_marked():
            return placement(self, offload_fraction)

    move = cls._move_new_state_to_right_device

    @functools.wraps(move)
    def _move_new_state_to_right_device(self):
        # :365-367 moves loaded state to "cpu" or "cuda" by sub-optimizer: on CPU both are this device, and
        # the state of the offloaded (host) sub-optimizers keeps the host mark
        saved_to = torch.Tensor.to

        def to(t, *args, **kwargs):
            if args and args[0] in ("cuda", "cpu"):
                out = t.detach().clone() if args[0] == "cpu" else t
                if args[0] == "cpu":
                    setattr(out, HOST_MARK, True)
                return out
            return saved_to(t, *args, **kwargs)

        torch.Tensor.to = to
        try:
            return move(self)
        finally:
            torch.Tensor.to = saved_to

    cls._get_sub_optimizer_param_groups = _get_sub_optimizer_param_groups
    cls._move_new_state_to_right_device = _move_new_state_to_right_device
    # :109-111 allocates the host gradient copies with pin_memory=True, which CPU torch refuses
    empty = torch.empty
    _torch_proxy_for(hdo)._overrides["empty"] = (
        lambda *args, pin_memory=False, **kwargs: _marked(empty(*args, **kwargs)))


def _marked(t: torch.Tensor) -> torch.Tensor:
    setattr(t, HOST_MARK, True)
    return t


PATCHES: tuple[Patch, ...] = (
    Patch(
        "current_device",
        ("utils.py:631", "models/common/embeddings/rotary_pos_embedding.py:162",
         "transformer/moe/router.py:90", "distributed/param_and_grad_buffer.py:806",
         "tensor_parallel/mappings.py:141,148,181,442", "tensor_parallel/layers.py:552",
         "pipeline_parallel/p2p_communication.py:190-202,321",
         "dist_checkpointing/strategies/state_dict_saver.py:252"),
        "torch.cuda.current_device() is used as the device of buffers on every step",
        _patch_current_device,
    ),
    Patch(
        "streams",
        ("transformer/moe/token_dispatcher.py:445,871-874", "pipeline_parallel/p2p_communication.py:242,398"),
        "CUDA streams/events/synchronize/record_stream have no CPU build",
        _patch_streams,
    ),
    Patch(
        "rng_tracker",
        ("tensor_parallel/random.py:235-277,422,444-458", "transformer/dot_product_attention.py:217"),
        "the model-parallel RNG tracker (and activation recompute) reads and writes CUDA generator states",
        _patch_rng_tracker,
    ),
    Patch(
        "all_to_all_splits",
        ("tensor_parallel/mappings.py:444",),
        "gloo's all_to_all_single rejects split sizes given as tensors",
        _patch_all_to_all_splits,
    ),
    Patch(
        "cuda_literals",
        ("pipeline_parallel/schedules.py:596,983,2138", "optimizer/optimizer.py:473,481,485,907",
         "optimizer/clip_grads.py:90,103,115,207", "transformer/utils.py:35,40", "utils.py:1207"),
        "tensor factories hard-code device='cuda' (transformer/utils.py: causal mask when no "
        "attention_mask is passed; utils.py: local_multi_tensor_l2_norm without apex)",
        _patch_cuda_literals,
    ),
    Patch(
        "clip_grads",
        ("optimizer/clip_grads.py:167,174",),
        "clip_grad_by_total_norm_fp32 asserts grads are torch.cuda.FloatTensor",
        _patch_clip_grads,
    ),
    Patch(
        "uneven_all_gather",
        ("tensor_parallel/mappings.py:150",),
        "gloo's all_gather needs equal sizes; expert-tensor parallel > 1 with EP > 1 gathers unequal "
        "token counts (token_dispatcher.py:696)",
        _patch_uneven_all_gather,
    ),
    Patch(
        "tied_embedding_cuda",
        ("models/common/language_module/language_module.py:244",),
        "tied input/output embeddings with pipeline parallel call Tensor.cuda() (not in the note)",
        _patch_tied_embedding_cuda,
    ),
    Patch(
        "cp_pos_emb_cuda",
        ("models/common/embeddings/rope_utils.py:62-64",),
        "under context parallelism the RoPE table's chunk ids per CP rank are a pinned host tensor moved with "
        ".cuda() (multi-latent attention's YaRN cache builds it at construction)",
        _patch_cp_pos_emb_cuda,
    ),
    Patch(
        "optimizer_param_types",
        ("optimizer/optimizer.py:671,690,695", "optimizer/distrib_optimizer.py:361,420,431,582"),
        "the bf16 (Float16OptimizerWithFloat16Params) and distributed optimizers accept only params "
        "whose type() is 'torch.cuda.*Tensor' and raise TypeError for CPU ones",
        _patch_optimizer_param_types,
    ),
    Patch(
        "hybrid_optimizer_host",
        ("optimizer/cpu_offloading/hybrid_optimizer.py:101,109-111,256,273-285,365-367",),
        "the HybridDeviceOptimizer (optimizer CPU offload) places params by is_cuda, pins host copies and "
        "moves loaded state with .to('cuda'); on CPU every tensor reads is_cuda=False and nothing can be pinned",
        _patch_hybrid_optimizer,
    ),
)
