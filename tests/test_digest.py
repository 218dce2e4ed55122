"""The weight-sync digests: each algorithm equals its definition transcribed independently, on every path
(plain, blocked, fused with the copy), and sees what a bad sync does to bytes."""
import hashlib

import numpy as np
import pytest
import torch
import xxhash

from moe.bridge import digest
from moe.bridge.digest import copy_with_digests, tensor_digest

ALGORITHMS = ["xxh3", "sums"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def reference_sums(t: torch.Tensor) -> str:
    """The sums definition transcribed directly: torch int32 row and column sums of the whole word matrix."""
    raw = _bytes(t)
    n, cols = raw.numel(), digest._COLS
    rows = n // (4 * cols)
    h = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16)
    if rows:
        words = raw[: rows * 4 * cols].view(torch.int32).view(rows, cols)
        h.update(words.sum(1, dtype=torch.int32).numpy())
        h.update(words.sum(0, dtype=torch.int32).numpy())
    if rows * 4 * cols < n:
        h.update(raw[rows * 4 * cols:].numpy())
    return f"sums:{t.dtype}:{tuple(t.shape)}:{h.hexdigest()}"


def reference_xxh3(t: torch.Tensor) -> str:
    """XXH3-128 of the whole byte string at once (the product streams it in blocks)."""
    return f"xxh3:{t.dtype}:{tuple(t.shape)}:{xxhash.xxh3_128_hexdigest(_bytes(t).numpy().tobytes())}"


REFERENCE = {"xxh3": reference_xxh3, "sums": reference_sums}
SHAPES = [(7,), (1024,), (3, 1000), (300, 1024), (1025, 517), (2, 700, 1024)]  # the last two span 1 MiB blocks


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_digest_equals_the_definition(algorithm, shape, dtype):
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 1e3).to(dtype)
    assert tensor_digest(t, algorithm) == REFERENCE[algorithm](t)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_digest_of_unaligned_and_strided_views(algorithm):
    base = torch.randn(600, 1030, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    odd = base.reshape(-1)[1:300001]  # starts mid-word
    assert tensor_digest(odd, algorithm) == REFERENCE[algorithm](odd)
    assert tensor_digest(base.t(), algorithm) == REFERENCE[algorithm](base.t().contiguous())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_changes_a_bad_sync_makes_are_seen(algorithm):
    t = torch.randn(512, 1024, generator=torch.Generator().manual_seed(3))
    d = tensor_digest(t, algorithm)
    one = t.clone()
    one[100, 5] = torch.nextafter(one[100, 5], torch.tensor(1e9))  # one ulp
    swap_in_row = t.clone()
    swap_in_row[7, [3, 900]] = swap_in_row[7, [900, 3]]
    swap_rows = t.clone()
    swap_rows[[1, 2]] = swap_rows[[2, 1]]
    variants = [one, swap_in_row, swap_rows, t.reshape(1024, 512), t.t(), t[:-1], t.to(torch.int32)]
    assert len({d, *(tensor_digest(v, algorithm) for v in variants)}) == 1 + len(variants)
    assert tensor_digest(t.clone(), algorithm) == d


def test_unknown_algorithm_and_algorithm_mismatch_are_named():
    t = torch.ones(4)
    with pytest.raises(ValueError, match="'md5' is unknown: choose one of xxh3, sums"):
        tensor_digest(t, "md5")
    with pytest.raises(digest.DigestMismatchError, match="digested 'w' with 'sums', the sender with 'xxh3'"):
        digest.verify({"w": tensor_digest(t, "xxh3")}, {"w": tensor_digest(t, "sums")})
    assert digest.algorithm_for("cpu") == "xxh3" and digest.algorithm_for("cuda") == "sums"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_copy_with_digests_copies_and_agrees(algorithm, shape):
    src = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    dst = torch.zeros_like(src)
    sent, loaded = copy_with_digests(dst, src, algorithm)
    assert torch.equal(dst, src)
    assert sent == loaded == REFERENCE[algorithm](src)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_copy_with_digests_into_a_slice_of_a_fused_parameter(algorithm):
    fused = torch.zeros(4, 2 * 300, 1024)  # like transformers' experts.gate_up_proj
    up = torch.randn(300, 1024)
    sent, loaded = copy_with_digests(fused[2, 300:], up, algorithm)
    assert torch.equal(fused[2, 300:], up) and fused[2, :300].abs().sum() == 0 and fused[1].abs().sum() == 0
    assert sent == loaded == REFERENCE[algorithm](up)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_copy_with_digests_dtype_change_is_not_hidden(algorithm):
    src = torch.randn(64, 1024)
    dst = torch.zeros(64, 1024, dtype=torch.bfloat16)
    sent, loaded = copy_with_digests(dst, src, algorithm)  # the unfused path; the bytes differ, so must the digests
    assert sent != loaded


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("rows", [100, 1000])  # one block, several blocks
def test_a_corrupted_copy_is_caught(monkeypatch, algorithm, rows):
    calls = []

    def bad_copy(dst, src):
        dst.copy_(src)
        if not calls:
            dst.reshape(-1).view(torch.uint8)[70] ^= 0x10  # one bit of the first block
        calls.append(1)

    monkeypatch.setattr(digest, "_copy_block", bad_copy)
    src = torch.randn(rows, 1024)
    dst = torch.empty_like(src)
    sent, loaded = copy_with_digests(dst, src, algorithm)
    assert len(calls) == (1 if rows == 100 else 4) and sent == REFERENCE[algorithm](src)
    assert loaded == REFERENCE[algorithm](dst) != sent
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
    receiver.load_weights_verified([("model.embed_tokens.weight", emb)], "xxh3")
    with pytest.raises(RuntimeError, match="lm_head.weight.*already loaded.*collision"):
        receiver.load_weights_verified([("lm_head.weight", emb)], "xxh3")
    receiver.end_weight_update()
    receiver.begin_weight_update()  # a new update starts clean
    receiver.load_weights([("lm_head.weight", emb)])
    receiver.end_weight_update()
