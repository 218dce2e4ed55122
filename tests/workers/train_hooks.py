"""Test-only registrations for trainer scenarios (imported by the workers, never by the product):
a reward with mixed scores on a random model, an engine that fails on demand, a rollout producer the package
does not know, a NaN injector."""
import hashlib
import os
import time

import torch
import torch.distributed as dist

from rlpo_mega.rewards import REWARDS
from rlpo_mega.rollout.producers import PRODUCERS, ScoredGroups, SyncProducer
from rlpo_mega.rollout import ENGINES, EngineError
from rlpo_mega.rollout.embedded import EmbeddedEngine


@REWARDS.register("test_parity")
def parity_reward(sample, cfg=None) -> float:
    """1.0 for an even number of characters: about half the samples of a random model, so every loss
    sees mixed groups (and dynamic sampling both keeps and drops some)."""
    return float(len(sample.response) % 2 == 0)


@ENGINES.register("test_flaky")
class FlakyEngine(EmbeddedEngine):
    """The embedded engine, except that generate() call number RLPO_FAIL_CALL (counted over the process,
    rebuilt engines included) fails on global rank RLPO_FAIL_RANK, like a crashed server."""
    calls = 0

    def generate(self, prompts, params, n=1, request_ids=None):
        FlakyEngine.calls += 1
        if (FlakyEngine.calls == int(os.environ.get("RLPO_FAIL_CALL", "0"))
                and dist.get_rank() == int(os.environ.get("RLPO_FAIL_RANK", "0"))):
            self._dead = True
            raise EngineError("test_flaky engine: simulated crash")
        return super().generate(prompts, params, n=n, request_ids=request_ids)


@PRODUCERS.register("test_replay")
class ReplayProducer(SyncProducer):
    """Collects on even steps and hands the same scored groups over again on the next step (one step off-policy):
    a producer registered outside the package, which the trainer runs through the same interface."""

    def __init__(self, *args):
        super().__init__(*args)
        self.last = None

    def collect(self, step, timer):
        if step % 2 == 1 and self.last is not None:
            last, self.last = self.last, None
            return ScoredGroups(last.samples, last.group_ids, {"producer/replayed": 1})
        self.last = super().collect(step, timer)
        return self.last


def inject_nan(trainer, steps):
    """Non-finite logits in the training forwards (not the eval-mode old-log-prob pass, whose NaN would
    be rejected as bad input) while trainer.step is in `steps`."""
    from rlpo_mega.model_setup import unwrap

    def hook(module, args, output):
        if trainer.step in steps and module.training:
            logits = output[0] if isinstance(output, tuple) else output
            bad = logits * float("nan")
            return (bad,) + tuple(output[1:]) if isinstance(output, tuple) else bad
        return output

    return unwrap(trainer.policy.chunks[0]).output_layer.register_forward_hook(hook)


def inject_nan_grad(trainer, steps):
    """A NaN in one parameter's gradient (the loss stays finite) while trainer.step is in `steps`: the
    gradient check, not the loss check, must skip the update."""
    from rlpo_mega.model_setup import unwrap

    param = next(unwrap(trainer.policy.chunks[0]).parameters())
    return param.register_hook(lambda g: g * float("nan") if trainer.step in steps else g)


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.state_dict().items()):
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@ENGINES.register("test_recorded")
class RecordedEngine(FlakyEngine):
    """The embedded engine keeping its own record: every generate() call with the weights it ran on (a digest of
    the model taken at each weight update, `syncs` in order) and what it returned. RLPO_DECODE_DELAY seconds per
    forward make a rollout last long enough for a weight sync to land in the middle of it; `forwards` counts the
    running call's forwards (0 between calls), for a test that must interrupt a call after its first tokens; `hold`
    (a test's predicate) keeps a call waiting before each forward while it says so."""
    record: list = []  # every call of every engine in this process
    syncs: list = []  # the digest after each weight update
    forwards: int = 0
    hold = None  # Optional[Callable[[], bool]]

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.weights = None
        delay = float(os.environ.get("RLPO_DECODE_DELAY", "0"))
        self.model.register_forward_pre_hook(lambda module, args: self._forward(delay))

    @staticmethod
    def _forward(delay: float):
        deadline = time.monotonic() + 60  # a predicate that never lets go fails the test's assertions, not the run
        while RecordedEngine.hold is not None and RecordedEngine.hold() and time.monotonic() < deadline:
            time.sleep(0.005)
        RecordedEngine.forwards += 1
        if delay:
            time.sleep(delay)

    def end_weight_update(self):
        super().end_weight_update()
        self.weights = weights_digest(self.model)
        RecordedEngine.syncs.append(self.weights)

    def generate(self, prompts, params, n=1, request_ids=None):
        weights = self.weights
        RecordedEngine.forwards = 0
        try:
            out = super().generate(prompts, params, n=n, request_ids=request_ids)
        finally:
            RecordedEngine.forwards = 0
        RecordedEngine.record.append({
            "weights": weights, "n": n, "max_new": params.max_new_tokens,
            "prompts": [[int(t) for t in p] for p in prompts],
            "out": [(list(s.response_ids), s.logprobs.clone(), None if s.routes is None else s.routes.clone(),
                     s.finish_reason) for s in out]})
        return out


@ENGINES.register("test_slow")
class SlowEngine(EmbeddedEngine):
    """The embedded engine, except that every generate() call on global rank RLPO_SLOW_RANK first sleeps
    RLPO_SLOW_S seconds (a long generation on one driver)."""

    def generate(self, prompts, params, n=1, request_ids=None):
        if dist.get_rank() == int(os.environ.get("RLPO_SLOW_RANK", "0")):
            time.sleep(float(os.environ.get("RLPO_SLOW_S", "0")))
        return super().generate(prompts, params, n=n, request_ids=request_ids)
