"""memory: peak bytes on known allocations, and the (S, S) evidence: naive ~S², fused SDPA ~S."""

import pytest
import torch
import torch.nn.functional as F

from posttrainllm.ops.attention import reference
from posttrainllm.measure.memory import peak_bytes, peak_live_bytes


def test_replay_of_known_events():
    # +100, +50 (150 live), -100, +80 (130), -50, -80: the peak is 150.
    events = [(1, 100), (2, 50), (3, -100), (4, 80), (5, -50), (6, -80)]
    assert peak_live_bytes(events) == 150
    assert peak_live_bytes([(1, -64)]) == 0  # only frees of older memory: nothing above the start
    assert peak_live_bytes([]) == 0


def test_a_known_allocation_is_reported_at_least_at_its_size(device):
    n_bytes = 3 * 1000 * 1000 * 4  # (3, 1000, 1000) fp32
    result = peak_bytes(lambda: torch.empty(3, 1000, 1000, device=device), device)
    assert result["peak_bytes"] >= n_bytes
    assert result["method"]


def test_temporaries_count_even_when_freed_before_the_call_returns(device):
    def scratch():
        tmp = torch.ones(1 << 20, device=device)  # 4 MiB, freed before returning
        return tmp.sum()

    assert peak_bytes(scratch, device)["peak_bytes"] >= 4 * (1 << 20)


def test_memory_that_existed_before_the_call_is_not_counted(device):
    held = torch.ones(1 << 20, device=device)
    assert peak_bytes(lambda: held.add_(1), device)["peak_bytes"] < 4 * (1 << 20)


def _attention_peaks(device: str, seq_len: int) -> tuple[int, int]:
    q, k, v = (torch.randn(1, 4, seq_len, 32, device=device) for _ in range(3))  # (B, H, S, D)
    with torch.no_grad():
        naive = peak_bytes(lambda: reference.attention(q, k, v, causal=True), device)["peak_bytes"]
        fused = peak_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)["peak_bytes"]
    return naive, fused


def test_naive_attention_grows_with_s_squared_and_sdpa_with_s(device):
    naive_256, fused_256 = _attention_peaks(device, 256)
    naive_512, fused_512 = _attention_peaks(device, 512)
    # (S, S) fp32 scores for B*H = 4 heads at S=512: 4 MiB, materialised by the naive path.
    assert naive_512 >= 4 * 512 * 512 * 4
    assert naive_512 / naive_256 > 3  # ~4x: S^2
    assert fused_512 / fused_256 < 2.6  # ~2x: S (output and logsumexp)
    assert fused_512 < naive_512 / 4


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="valid choices are cpu, cuda"):
        peak_bytes(lambda: None, "mps")
