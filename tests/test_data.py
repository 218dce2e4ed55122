"""Prompt data: bad files give one error naming file and line; seeded shuffling; the resumable cursor;
chat templates through the committed tiny tokenizer; n samples per prompt; dynamic sampling's refill."""
import json
import os

import pytest
import torch

from rlpo_mega.data import DataError, PromptSampler, collect_groups, group_ids, load_prompts, render_prompt

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


def _rollout_by_index(acc_of):
    """Fake engine + reward: the group of record i scores acc_of(i) correct answers out of n."""
    calls = []

    def rollout(items, n=4):
        calls.append(len(items))
        scores = []
        for it in items:
            k = acc_of(it.record.index)
            scores += [1.0] * k + [0.0] * (n - k)
        return torch.tensor(scores), [(it.uid, j) for it in items for j in range(n)]

    return rollout, calls


def test_dynamic_sampling_refills():
    recs = load_prompts(TOY)
    # records 0 mod 3: all wrong; 1 mod 3: all right; 2 mod 3: mixed -> only a third of groups kept
    rollout, calls = _rollout_by_index(lambda i: [0, 4, 2][i % 3])
    s = PromptSampler(recs, seed=1)
    batch = collect_groups(s, rollout, target_groups=6, n=4, max_tries=10, oversample=2.0)
    r = batch.report
    assert r.complete and r.groups_kept == 6 and len(batch.items) == 6
    assert all(it.record.index % 3 == 2 for it in batch.items)
    assert len(batch.samples) == 24 and batch.scores.shape == (24,)
    assert batch.samples[:4] == [(batch.items[0].uid, j) for j in range(4)]  # group-major, aligned
    assert batch.group_ids.tolist() == [u for it in batch.items for u in [it.uid] * 4]
    assert calls[0] == 12 and r.tries == len(calls) >= 2 and r.prompts_drawn == sum(calls)
    assert r.dropped_all_zero + r.dropped_all_one + r.groups_kept <= r.prompts_drawn
    assert r.dropped_all_zero > 0 and r.dropped_all_one > 0
    assert r.stats()["dynamic_sampling/complete"] == 1


def test_dynamic_sampling_bounded_and_disabled():
    rollout, calls = _rollout_by_index(lambda i: 4 if i % 50 else 2)  # ~2% of groups informative
    batch = collect_groups(PromptSampler(load_prompts(TOY), seed=0), rollout, target_groups=8, n=4, max_tries=2)
    assert batch.report.tries == 2 and not batch.report.complete and batch.report.groups_kept < 8
    assert batch.scores.numel() == 4 * batch.report.groups_kept
    rollout, calls = _rollout_by_index(lambda i: 4)
    batch = collect_groups(PromptSampler(load_prompts(TOY), seed=0), rollout, target_groups=3, n=4, enabled=False)
    assert calls == [3] and len(batch.items) == 3  # no filtering, one try
    with pytest.raises(ValueError, match="returned 8 scores"):
        collect_groups(PromptSampler(load_prompts(TOY)), lambda items: (torch.zeros(8), [0] * 8), 3, 4)
