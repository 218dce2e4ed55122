"""Prompt data: bad files give one error naming file and line; seeded shuffling; the resumable cursor;
chat templates through the committed tiny tokenizer; n samples per prompt; dynamic sampling's refill."""
import json
import os

import pytest
import torch

from rlpo_mega.data import DataError, PromptSampler, group_ids, load_prompts, render_prompt
from rlpo_mega.rollout.dynamic_sampling import GroupCollector

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "configs", "tokenizers", "tiny_char")
TOY = os.path.join(ROOT, "configs", "data", "toy_reverse_train.jsonl")


def _write(tmp_path, content: bytes, name="p.jsonl"):
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


GOOD = b'{"prompt": "1+1=", "answer": 2}\n'


@pytest.mark.parametrize("content, line, msg", [
    (b"", 1, "file is empty"),
    (b"\n  \n", 1, "file is empty"),
    (GOOD + b'{"question": "1+1=", "answer": "2"}\n', 2, "missing field 'prompt' (fields present: question, answer"),
    (GOOD + GOOD + b'{"prompt": "1+1="}\n', 3, "missing field 'answer'"),
    (GOOD + b'{"prompt": "x", "answer": null}\n', 2, "missing field 'answer'"),
    (GOOD + b'{"prompt": 17, "answer": "2"}\n', 2, "field 'prompt' must be a string or a non-empty list"),
    (GOOD + b'{"prompt": [{"role": "user"}], "answer": "2"}\n', 2, "message 0"),
    (GOOD + b'{"prompt": "x", "answer": ["2"]}\n', 2, "field 'answer' must be a string or a number, got list"),
    (GOOD + b'{"prompt": "x", "answer": true}\n', 2, "got bool"),
    (GOOD + b'{"prompt": "   ", "answer": "2"}\n', 2, "empty string"),
    (GOOD + b'["1+1=", "2"]\n', 2, "expected a JSON object"),
    (GOOD + b'{"prompt": "caf\xe9", "answer": "2"}\n', 2, "not valid UTF-8 (byte 0xe9 at column 16)"),
    (GOOD + b'{"prompt": "x", "answer": "2"\n', 2, "malformed JSON at column 30"),
    (GOOD + b'\n{"prompt": "x" "answer": 1}\n', 3, "malformed JSON"),  # blank lines still count
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, line, msg):
    path = _write(tmp_path, content)
    with pytest.raises(DataError) as e:
        load_prompts(path)
    assert str(e.value).startswith(f"{path}: line {line}: "), str(e.value)
    assert msg in str(e.value)


def test_bad_path_and_format(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="cannot tell the format"):
        load_prompts(_write(tmp_path, GOOD, "p.txt"))
    assert len(load_prompts(_write(tmp_path, GOOD, "p.txt"), fmt="jsonl")) == 1


def test_field_names_and_metadata(tmp_path):
    path = _write(tmp_path, b'{"q": "2+2=", "a": 4, "level": 3}\n{"q": [{"role": "user", "content": "hi"}], "a": "x"}\n')
    recs = load_prompts(path, prompt_key="q", answer_key="a")
    assert recs[0].prompt == "2+2=" and recs[0].reference == "4" and recs[0].metadata == {"level": 3}
    assert recs[1].prompt == [{"role": "user", "content": "hi"}]


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    assert [r.reference for r in load_prompts(path)] == ["1", "2"]
    pq.write_table(pa.table({"prompt": ["a", None], "answer": ["1", "2"]}), path)
    with pytest.raises(DataError, match=f"{path}: row 2: missing field 'prompt'"):
        load_prompts(path)
    pq.write_table(pa.table({"prompt": ["a"], "solution": ["1"]}), path)
    with pytest.raises(DataError, match=f"{path}: row 1: missing field 'answer'"):
        load_prompts(path)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def test_tiny_tokenizer_fits_the_tiny_models(tok):
    for name in ("tiny_qwen3_moe.json", "tiny_mixtral.json"):
        with open(os.path.join(ROOT, "configs", "models", name)) as f:
            assert len(tok) <= json.load(f)["vocab_size"]
    ids = tok("reverse: abc")["input_ids"]
    assert len(ids) == len("reverse: abc") and tok.decode(ids) == "reverse: abc"


def test_chat_template(tok):
    ids = render_prompt(tok, "reverse: ab")
    assert tok.decode(ids) == "<|user|>reverse: ab<|end|><|assistant|>"
    ids = render_prompt(tok, [{"role": "user", "content": "hi"}], system_prompt="be brief")
    assert tok.decode(ids) == "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    assert tok.decode(render_prompt(tok, "ab", chat_template="off")) == "ab"
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        render_prompt(tok, [{"role": "user", "content": "hi"}], chat_template="off")
    tok_plain = type(tok).from_pretrained(TOKENIZER)
    tok_plain.chat_template = None
    assert tok.decode(render_prompt(tok_plain, "ab")) == "ab"  # auto: no template, plain text
    with pytest.raises(DataError, match="has no chat template"):
        render_prompt(tok_plain, "ab", chat_template="on")


def _draw(sampler, k):
    return [it.record.index for it in sampler.next_prompts(k)]


def test_shuffle_is_seeded_and_covers_each_epoch():
    recs = load_prompts(TOY)
    n = len(recs)
    a, b, c = (PromptSampler(recs, seed=s) for s in (7, 7, 8))
    first = _draw(a, n)
    assert first == _draw(b, n) and first != _draw(c, n)
    assert sorted(first) == list(range(n))  # an epoch is a permutation
    second = _draw(a, n)
    assert sorted(second) == list(range(n)) and second != first  # a new order each epoch
    assert _draw(PromptSampler(recs, shuffle=False), 5) == [0, 1, 2, 3, 4]


def test_cursor_resume(tok):
    recs = load_prompts(TOY)[:10]
    ref = PromptSampler(recs, tok, seed=3)
    full = ref.next_prompts(25)  # crosses two epoch boundaries
    s = PromptSampler(recs, tok, seed=3)
    s.next_prompts(13)
    state = json.loads(json.dumps(s.state_dict()))  # survives a checkpoint round trip
    resumed = PromptSampler(recs, tok, seed=3)
    resumed.load_state_dict(state)
    rest = resumed.next_prompts(12)
    assert [(it.uid, it.record.index, it.input_ids) for it in rest] == \
           [(it.uid, it.record.index, it.input_ids) for it in full[13:]]
    with pytest.raises(DataError, match="seed=3 but this run has seed=4"):
        PromptSampler(recs, seed=4).load_state_dict(state)
    with pytest.raises(DataError, match="num_records=10 but this run has num_records=9"):
        PromptSampler(recs[:9], seed=3).load_state_dict(state)


def test_n_samples_group_ids():
    s = PromptSampler(load_prompts(TOY), seed=0)
    items = s.next_prompts(3)
    assert group_ids(items, 4).tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert group_ids(s.next_prompts(2), 2).tolist() == [3, 3, 4, 4]  # unique over the run, not per step


def test_from_config(tok):
    from rlpo_mega.config import PromptDataConfig

    cfg = PromptDataConfig(path=TOY, seed=None)
    s = PromptSampler.from_config(cfg, tok, run_seed=5)
    assert s.seed == 5 and tok.decode(s.next_prompts(1)[0].input_ids).startswith("<|user|>reverse: ")
    with pytest.raises(DataError, match="prompts.path is not set"):
        PromptSampler.from_config(PromptDataConfig())


class _Answer:
    def __init__(self, correct: float, finish_reason: str = "stop"):
        self.correct, self.finish_reason = correct, finish_reason


def _stream_by_index(acc_of, log, n=4, late=()):
    """A fake engine stream: record i's group has acc_of(i) correct answers out of n. Groups come in item order;
    after send("finish") the groups of records in `late` end aborted, the others complete (they had ended)."""
    def stream(items, k):
        log.append(len(items))
        finished = False
        for i, it in enumerate(items):
            aborted = finished and it.record.index in late
            c = acc_of(it.record.index)
            got = yield i, [_Answer(float(j < c), "abort" if aborted and j else "stop") for j in range(n)]
            if got == "finish":
                finished = True
                log.append("finish")
    return stream


def _score(item, samples):
    return [s.correct for s in samples]


def _chunks(sampler, k):
    return lambda: sampler.next_prompts(k)


def test_dynamic_sampling_streams_and_carries_surplus():
    """Records 0 mod 3: all wrong; 1 mod 3: all right; 2 mod 3: mixed. A rank's share of 3 groups: its chunk
    of 12 prompts is scored group by group, the stream is told to finish at the third mixed group, the groups
    that end after it are carried (complete) or dropped (aborted); the next step takes the carried ones first,
    and a group older than max_carry_steps policy versions is never trained on."""
    recs = load_prompts(TOY)
    log = []
    late = {r.index for r in recs if r.index % 3 == 0}  # all-wrong records end aborted after the finish
    s = PromptSampler(recs, seed=1)
    collector = GroupCollector(max_chunks=3, max_carry_steps=1)
    kept, r = collector.collect(3, 7, _chunks(s, 12), _stream_by_index(lambda i: [0, 4, 2][i % 3], log, late=late),
                                _score)
    assert len(kept) == 3 and all(g.item.record.index % 3 == 2 and g.version == 7 for g in kept)
    assert log[0] == 12 and log[1] == "finish" and log.count(12) == 1  # one chunk: no whole-batch retry
    assert r.tries == 1 and r.prompts_drawn == 12 and r.groups_kept == 3 and r.complete
    assert r.carried_out == len(collector.carry) and r.aborted + r.carried_out + 3 + r.dropped_all_zero + \
        r.dropped_all_one == 12
    assert r.dropped_all_zero > 0 and r.dropped_all_one > 0
    assert r.aborted == 2 and r.carried_out == 1  # (this seed's chunk: 2 all-wrong and 1 mixed group after it)
    carried = list(collector.carry)
    assert carried and all(g.version == 7 and g.item.record.index % 3 == 2 for g in carried)
    # the next step (version 8) starts from the carried groups
    log.clear()
    kept2, r2 = collector.collect(len(carried), 8, _chunks(s, 12), _stream_by_index(lambda i: 2, log), _score)
    assert kept2 == carried and r2.carried_in == len(carried) and r2.tries == 0 and log == []
    # a surplus group two versions old is stale: dropped, counted, never trained on
    collector.carry = carried
    kept3, r3 = collector.collect(1, 9, _chunks(s, 4), _stream_by_index(lambda i: 2, log), _score)
    assert r3.carry_stale == len(carried) and r3.carried_in == 0 and all(g.version == 9 for g in kept3)
    stats = r.stats()
    assert stats["dynamic_sampling/kept"] == 3 and stats["dynamic_sampling/complete"] == 1
    assert stats["dynamic_sampling/carried_out"] == len(carried)


def test_dynamic_sampling_bounded_and_without_carry():
    log = []
    s = PromptSampler(load_prompts(TOY), seed=0)
    # ~2% of groups informative: max_chunks chunks, then a short share
    kept, r = GroupCollector(max_chunks=2).collect(8, 0, _chunks(s, 8), _stream_by_index(
        lambda i: 4 if i % 50 else 2, log), _score)
    assert r.tries == 2 and log == [8, 8] and not r.complete and len(kept) < 8
    # max_carry_steps=0: the stream is closed at the share (nothing scored past it, nothing carried)
    log.clear()
    c = GroupCollector(max_chunks=3, max_carry_steps=0)
    kept, r = c.collect(2, 0, _chunks(s, 10), _stream_by_index(lambda i: 2, log), _score)
    assert len(kept) == 2 and c.carry == [] and r.carried_out == 0 and r.aborted == 8 and "finish" not in log
    with pytest.raises(ValueError, match="max_chunks"):
        GroupCollector(max_chunks=0)
