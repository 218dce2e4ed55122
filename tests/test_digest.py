"""The weight-sync digest: one definition on every path, sensitive to what a bad sync does to bytes."""
import numpy as np
import pytest
import torch

from rlpo_mega.weight_sync import digest
from rlpo_mega.weight_sync.digest import copy_with_digests, tensor_digest


def reference_digest(t: torch.Tensor) -> str:
    """The definition transcribed directly: torch int32 row and column sums of the whole word matrix."""
    import hashlib

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
    n, cols = raw.numel(), digest._COLS
    rows = n // (4 * cols)
    h = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16)
    if rows:
        words = raw[: rows * 4 * cols].view(torch.int32).view(rows, cols)
        h.update(words.sum(1, dtype=torch.int32).numpy())
        h.update(words.sum(0, dtype=torch.int32).numpy())
    if rows * 4 * cols < n:
        h.update(raw[rows * 4 * cols:].numpy())
    return f"{t.dtype}:{tuple(t.shape)}:{h.hexdigest()}"


SHAPES = [(7,), (1024,), (3, 1000), (300, 1024), (1025, 517), (2, 700, 1024)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_cpu_digest_equals_the_definition(shape, dtype):
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 1e3).to(dtype)
    assert tensor_digest(t) == reference_digest(t)


def test_digest_of_unaligned_and_strided_views():
    base = torch.randn(600, 1030, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    odd = base.reshape(-1)[1:300001]  # starts mid-word
    assert tensor_digest(odd) == reference_digest(odd)
    assert tensor_digest(base.t()) == reference_digest(base.t().contiguous())


def test_changes_a_bad_sync_makes_are_seen():
    t = torch.randn(512, 1024, generator=torch.Generator().manual_seed(3))
    d = tensor_digest(t)
    one = t.clone()
    one[100, 5] = torch.nextafter(one[100, 5], torch.tensor(1e9))  # one ulp
    swap_in_row = t.clone()
    swap_in_row[7, [3, 900]] = swap_in_row[7, [900, 3]]
    swap_rows = t.clone()
    swap_rows[[1, 2]] = swap_rows[[2, 1]]
    assert len({d, tensor_digest(one), tensor_digest(swap_in_row), tensor_digest(swap_rows),
                tensor_digest(t.reshape(1024, 512)), tensor_digest(t.t()), tensor_digest(t[:-1])}) == 7
    assert tensor_digest(t.clone()) == d


@pytest.mark.parametrize("shape", SHAPES)
def test_copy_with_digests_copies_and_agrees(shape):
    src = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    dst = torch.zeros_like(src)
    sent, loaded = copy_with_digests(dst, src)
    assert torch.equal(dst, src)
    assert sent == loaded == reference_digest(src)


def test_copy_with_digests_into_a_slice_of_a_fused_parameter():
    fused = torch.zeros(4, 2 * 300, 1024)  # like transformers' experts.gate_up_proj
    up = torch.randn(300, 1024)
    sent, loaded = copy_with_digests(fused[2, 300:], up)
    assert torch.equal(fused[2, 300:], up) and fused[2, :300].abs().sum() == 0 and fused[1].abs().sum() == 0
    assert sent == loaded


def test_copy_with_digests_dtype_change_is_not_hidden():
    src = torch.randn(64, 1024)
    dst = torch.zeros(64, 1024, dtype=torch.bfloat16)
    sent, loaded = copy_with_digests(dst, src)  # the unfused path; the bytes differ, so must the digests
    assert sent != loaded


def test_a_corrupted_copy_is_caught(monkeypatch):
    calls = []

    def bad_copy(dst, src):
        np.copyto(dst, src)
        if not calls:
            dst.reshape(-1)[17] ^= 1 << 20
        calls.append(1)

    monkeypatch.setattr(digest, "_copy_block", bad_copy)
    src = torch.randn(1000, 1024)
    dst = torch.empty_like(src)
    sent, loaded = copy_with_digests(dst, src)
    assert len(calls) > 1 and sent == reference_digest(src)
    assert loaded == reference_digest(dst) != sent
    with pytest.raises(digest.DigestMismatchError, match="refusing to roll out"):
        digest.verify({"w": sent}, {"w": loaded})


def test_receiver_refuses_a_mapping_collision():
    """Two streamed names landing on one engine slice (here lm_head onto a tied embedding) would let the
    second overwrite the first after its digest was taken: the receiver refuses instead."""
    from transformers import AutoModelForCausalLM

    from moe.model import load_hf_config
    from rlpo_mega.weight_sync.transports import HFModelReceiver

    hf = load_hf_config("configs/models/tiny_mixtral.json")
    assert hf.tie_word_embeddings
    receiver = HFModelReceiver(AutoModelForCausalLM.from_config(hf))
    emb = torch.randn(hf.vocab_size, hf.hidden_size)
    receiver.begin_weight_update()
    receiver.load_weights_verified([("model.embed_tokens.weight", emb)])
    with pytest.raises(RuntimeError, match="lm_head.weight.*already loaded.*collision"):
        receiver.load_weights_verified([("lm_head.weight", emb)])
    receiver.end_weight_update()
    receiver.begin_weight_update()  # a new update starts clean
    receiver.load_weights([("lm_head.weight", emb)])
    receiver.end_weight_update()
