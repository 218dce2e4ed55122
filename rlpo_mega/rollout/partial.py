"""Partial rollout: a sample interrupted by a weight update continues from the tokens it has.

A weight update during generation aborts the running requests (their answers carry what was generated so far:
tokens, log-probs, routes). After the new weights are loaded, each interrupted sample is sent again as the
prompt followed by its tokens, with max_new_tokens reduced by their count; the continuation's answer is joined
to the first part:

  response     = first part's tokens ++ the continuation's tokens (cut at the sample's max_new_tokens)
  log-probs    = each token's own, as the policy that sampled it gave it (the behaviour policy, per token)
  versions     = per token, the weight version the engine held when it sampled it: spans [(version, count)]
  routes (R3)  = row t is the routing of the forward that produced the distribution token t + 1 was sampled
                 from. The first part's rows [0, P + k - 1) are kept (P prompt tokens, k tokens so far); the
                 continuation's prefill recomputes those positions under the new weights and its rows for them
                 are discarded; its rows from P + k - 1 on (the last kept token's forward onwards) are taken.

So a token is always replayed with the routes it was sampled under, and the prefix is never silently
re-routed by the new version's prefill. An interrupted part whose routes do not cover its tokens (SGLang
answers a request aborted while queued or retracted without them) cannot be continued under that rule: it is
restarted from its prompt, and counted.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Optional

import torch

from rlpo_mega.rollout.base import EngineError, Sample, SampleMeta


def versions_of(sample: Sample) -> list[tuple[int, int]]:
    """The sample's per-token weight versions as spans [(version, count)] (meta.versions)."""
    return list(sample.meta.versions)


def span_versions(spans: list[tuple[int, int]]) -> torch.Tensor:
    """Spans [(version, count)] -> int64 [response_len], each token's version."""
    if not spans:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.full((n,), v, dtype=torch.int64) for v, n in spans])


def tag(sample: Sample, version: int, held: bool = False) -> Sample:
    """A fresh answer: every token sampled by `version`, which the engine's own record confirms when it keeps one
    (meta.weight_version, set by RolloutEngine.set_weight_version; SGLang's spans when it changed mid-request).
    held (rollout.partial_rollout_kv=keep): weight updates land under running requests, so the engine's record
    is each token's version: spans in order, from `version` on (a request sent while the engine was held starts
    on the next one)."""
    n = len(sample.response_ids or ())
    said, spans = sample.meta.weight_version, sample.meta.weight_versions
    if held and (spans or said is not None):
        try:
            got = ([(int(s["version"]), int(s["end"]) - int(s["start"])) for s in spans] if spans
                   else [(int(said), n)])
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"the engine answered request {sample.meta.request_id} with weight versions "
                              f"{spans or said!r}, not the step numbers set_weight_version named ({e})") from None
        versions = [v for v, _ in got]
        if versions != sorted(versions) or versions[0] < version or sum(c for _, c in got) != n:
            raise EngineError(f"the engine answered request {sample.meta.request_id} ({n} tokens, sent on version "
                              f"{version}) with weight versions {spans or said}: not the updates it ran through")
        sample.meta.versions = merge_spans(got)
        return sample
    if (said is not None and said != str(version)) or any(s.get("version") != str(version) for s in spans or ()):
        raise EngineError(f"the engine answered request {sample.meta.request_id} "
                          f"with weight version {spans or said}, but it was sent on version {version}: a weight "
                          "update reached a running request")
    sample.meta.versions = [(int(version), n)] if n else []
    return sample


def continuable(part: Sample) -> bool:
    """An aborted part can continue when it has tokens and routes for exactly prompt + tokens - 1 positions
    (from part.routes_from, when the engine was asked for the rows from there only), or no routes at all
    when the engine returns none."""
    k = len(part.response_ids or ())
    if k == 0:
        return False
    if part.routes is None:
        return not part.has_routes
    return int(part.routes.shape[0]) == len(part.prompt_ids) + k - 1 - part.routes_from


def continuation_prompt(part: Sample) -> list[int]:
    return [int(t) for t in part.prompt_ids] + [int(t) for t in part.response_ids]


def join(part: Sample, cont: Sample, max_new_tokens: int, stop_token_ids=()) -> Sample:
    """The interrupted `part` (tagged) followed by its continuation `cont` (tagged, prompt = part's prompt +
    tokens): one sample, cut at max_new_tokens (the continuation may have been asked for more when the engine
    takes one budget per call) and at its first stop token."""
    p, k = len(part.prompt_ids), len(part.response_ids)
    ids = list(part.response_ids) + list(cont.response_ids)
    lps = torch.cat([part.logprobs.float(), cont.logprobs.float()])
    spans = versions_of(part) + versions_of(cont)
    finish = cont.finish_reason
    end = len(ids)
    stops = set(stop_token_ids)
    for i in range(k, len(ids)):  # a stop the continuation sampled past (it ran on its own budget)
        if ids[i] in stops:
            end, finish = i + 1, "stop"
            break
    if end > max_new_tokens:
        end, finish = max_new_tokens, "length"
    ids, lps = ids[:end], lps[:end]
    spans = merge_spans(_cut(spans, end))
    if (part.routes is None) != (cont.routes is None):
        raise EngineError(f"a continued sample (prompt {part.prompt_index}) has routes in one part only: the engine "
                          "returned routed experts for one request and not for the other")
    routes: Optional[torch.Tensor] = None
    if part.routes is not None:  # the continuation's rows may start at cont.routes_from (asked for from p + k - 1)
        c0 = cont.routes_from
        if c0 > p + k - 1 or part.routes_from:
            raise EngineError(f"a continued sample (prompt {part.prompt_index}) lacks routing rows: the continuation's "
                              f"start at {c0} (its part's at {part.routes_from}), the rows needed from {p + k - 1}")
        routes = torch.cat([part.routes[:p + k - 1], cont.routes[p + k - 1 - c0:p + end - 1 - c0]])
    # the continuation's own record, the part's where the continuation has none
    meta = replace(cont.meta, **{f.name: getattr(part.meta, f.name) for f in fields(SampleMeta)
                                 if getattr(cont.meta, f.name) is None},
                   versions=spans, parts=part.meta.parts + cont.meta.parts)
    return replace(cont, prompt_ids=list(part.prompt_ids), response_ids=ids, logprobs=lps, finish_reason=finish,
                   routes=routes, routes_from=0, prompt_index=part.prompt_index, meta=meta, trace_checked=False,
                   has_routes=routes is not None, replaced=None)


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for v, c in spans:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + c)
        elif c:
            out.append((v, c))
    return out


def _cut(spans: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    out, left = [], n
    for v, c in spans:
        if left <= 0:
            break
        out.append((v, min(c, left)))
        left -= c
    return out
