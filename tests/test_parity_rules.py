"""The parity contract without blind spots: the per-row rule, the logsumexp's own contract,
and check_path failing on whatever is missing.

The long-sequence cases are the ones the tensor-wide rule alone passed: at bf16, causal,
B=1, H=2, S=4096, D=128 the last query rows are ~40x smaller than row 0, so one allowance
for the whole tensor swallows a zeroed last row or a last row that skipped its final block.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from posttrainllm.config import Contract

from posttrainllm.lab.configure import load
from posttrainllm.lab import parity
from posttrainllm.ops.attention import reference as attention_reference
from posttrainllm.ops.matmul import reference as matmul_reference

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SEQ, HEADS, HEAD_DIM, TAIL = 4096, 2, 128, 64


def precision(name: str):
    return load([f"precision={name}"]).precision


@pytest.fixture(scope="module")
def long_attention():
    """(precision, seed) -> inputs, fp64 oracle, in-precision reference baseline and SDPA output; each built once."""
    cache: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def get(name: str, seed: int) -> dict[str, torch.Tensor]:
        if (name, seed) not in cache:
            gen = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=gen).to(DTYPES[name]) for _ in range(3))
            cache[name, seed] = {
                "q": q, "k": k, "v": v,
                "oracle": attention_reference.attention(q.double(), k.double(), v.double(), causal=True),
                "baseline": attention_reference.attention(q, k, v, causal=True),
                "sdpa": F.scaled_dot_product_attention(q, k, v, is_causal=True),
            }
        return cache[name, seed]

    return get


def zeroed_last_row(case):
    out = case["sdpa"].clone()
    out[:, :, -1] = 0
    return out


def dropped_tail_block(case):
    """The last query row computed without its last 64 keys (a kernel that skips its final KV block)."""
    out = case["sdpa"].clone()
    q, k, v = case["q"][:, :, -1:], case["k"][:, :, :-TAIL], case["v"][:, :, :-TAIL]
    out[:, :, -1:] = F.scaled_dot_product_attention(q, k, v)  # every kept key is visible to the last query
    return out


# --- the per-row rule on hand-worked numbers ----------------------------------------------

RULE = Contract(error_multiple=2.0, floor_rel=0.01, atol=1.0, rtol=0.0, max_mismatch=0.0,
                row_floor_rel=1e-5, grad_row_floor_rel=0.1)


def test_each_row_is_judged_at_its_own_scale():
    oracle = torch.tensor([[100.0, -50.0], [0.1, 0.2]], dtype=torch.float64)
    baseline = oracle + torch.tensor([[1.0, 0.0], [0.001, 0.0]], dtype=torch.float64)
    candidate = oracle + torch.tensor([[0.0, 0.0], [0.05, 0.0]], dtype=torch.float64)
    check = parity.check_output(candidate, oracle, baseline, RULE)
    # tensor-wide: 2 * 1 + 0.01 * 100 = 3 (passes); row 1: 2 * 0.001 + 0.01 * 0.2 + 1e-5 * 100 = 0.005
    assert check["allowed_abs_err"] == pytest.approx(3.0) and check["max_abs_err"] < 3.0
    assert check["worst_row"]["index"] == (1,)
    assert check["worst_row"]["allowed_abs_err"] == pytest.approx(0.005)
    assert check["worst_row"]["max_abs_err"] == pytest.approx(0.05)
    assert check["verdict"] == "fail" and check["rows_failed"] == 1
    assert check["reason"].startswith("row (1,): max_abs_err 0.05 > row allowed 0.005")
    # a gradient row also gets grad_row_floor_rel x the tensor's max: 0.004 + 0.1 * 100
    assert parity.check_output(candidate, oracle, baseline, RULE, gradient=True)["verdict"] == "pass"
    # row_ndim=0: every element is a row; element (1, 0) is the one off
    assert parity.check_output(candidate, oracle, baseline, RULE, row_ndim=0)["worst_row"]["index"] == (1, 0)


def test_an_exactly_zero_oracle_row_takes_the_fallback_scale():
    oracle = torch.zeros(2, 3, dtype=torch.float64)  # dQ when every query sees one key
    candidate = torch.tensor([[0.0, 2e-7, 0.0], [0.0, 0.0, 0.0]])
    contract = Contract(error_multiple=8.0, floor_rel=1e-6, grad_row_floor_rel=1e-5)
    passed = parity.check_output(candidate, oracle, torch.zeros(2, 3), contract, fallback_scale=3.0, gradient=True)
    assert passed["verdict"] == "pass"
    assert passed["worst_row"]["allowed_abs_err"] == pytest.approx(3e-5)
    failed = parity.check_output(candidate, oracle, torch.zeros(2, 3), contract, gradient=True)
    assert failed["verdict"] == "fail" and "row (0,)" in failed["reason"]


def test_a_non_finite_baseline_is_no_bound():
    oracle = torch.ones(2, 2, dtype=torch.float64)
    baseline = torch.tensor([[1.0, float("inf")], [1.0, 1.0]])
    check = parity.check_output(oracle + 0.5, oracle, baseline, RULE)
    assert check["verdict"] == "fail" and "baseline has non-finite values" in check["reason"]


# --- long sequences: the damage the tensor-wide rule missed --------------------------------

@pytest.mark.parametrize("seed", [1, 2])
def test_bf16_long_sequence_clean_sdpa_passes(long_attention, seed):
    case = long_attention("bf16", seed)
    check = parity.check_output(case["sdpa"], case["oracle"], case["baseline"], precision("bf16").contract)
    assert check["verdict"] == "pass", check["reason"]
    assert check["rows"] == HEADS * SEQ and check["worst_row"]["ratio"] < 0.5


@pytest.mark.parametrize("damage", [zeroed_last_row, dropped_tail_block])
@pytest.mark.parametrize("seed", [1, 2])
def test_bf16_long_sequence_damaged_last_row_fails(long_attention, seed, damage):
    case = long_attention("bf16", seed)
    check = parity.check_output(damage(case), case["oracle"], case["baseline"], precision("bf16").contract)
    assert check["max_abs_err"] <= check["allowed_abs_err"]  # the tensor-wide rule alone passes it
    assert check["verdict"] == "fail"
    assert check["worst_row"]["index"][2] == SEQ - 1 and check["rows_failed"] == HEADS
    assert f"row (0, {check['worst_row']['index'][1]}, {SEQ - 1}): max_abs_err" in check["reason"]
    assert check["worst_row"]["ratio"] > 2.0


@pytest.mark.parametrize("name", ["fp16", "fp32"])
def test_zeroed_last_row_fails_in_fp16_and_fp32_too(long_attention, name):
    case = long_attention(name, 1)
    contract = precision(name).contract
    assert parity.check_output(case["sdpa"], case["oracle"], case["baseline"], contract)["verdict"] == "pass"
    check = parity.check_output(zeroed_last_row(case), case["oracle"], case["baseline"], contract)
    assert check["verdict"] == "fail"
    assert check["worst_row"]["index"][2] == SEQ - 1 and check["rows_failed"] == HEADS
    assert f", {SEQ - 1}): max_abs_err" in check["reason"]


# --- a clean Triton-free path passes in every precision, gradients included ------------------

def _attention_case(dtype, seed, heads, kv_heads, seq_len, head_dim, causal, fn, upcast=False):
    """out and grad_q/k/v of fn(q, k, v) for dO drawn from the seed, inputs in `dtype`; upcast: fn runs in fp64."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq_len, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, kv_heads, seq_len, head_dim, generator=gen).to(dtype) for _ in range(2))
    grad_out = torch.randn(1, heads, seq_len, head_dim, generator=gen).to(dtype)
    run_dtype = torch.float64 if upcast else dtype
    leaves = [x.to(run_dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, causal)
    grads = torch.autograd.grad(out, leaves, grad_out.to(run_dtype))
    return {"out": out.detach(), **{f"grad_{n}": g for n, g in zip("qkv", grads)}}


def _reference(q, k, v, causal):
    return attention_reference.attention(q, k, v, causal=causal)


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


ATTENTION_CASES = {  # name: (heads, kv_heads, seq_len, head_dim, causal)
    "mha-causal-S256": (2, 2, 256, 64, True),
    "gqa-S200": (4, 2, 200, 32, False),
    "mqa-causal-S100": (4, 1, 100, 32, True),
}


@pytest.mark.parametrize("name", ["fp32", "tf32", "bf16", "fp16"])
def test_sdpa_against_the_reference_passes_in_every_precision(name):
    p = precision(name)
    outputs, oracles, baselines = [], [], []
    for seed, dims in enumerate(ATTENTION_CASES.values()):
        outputs.append(_attention_case(DTYPES[name], seed, *dims, _sdpa))
        baselines.append(_attention_case(DTYPES[name], seed, *dims, _reference))
        oracles.append(_attention_case(DTYPES[name], seed, *dims, _reference, upcast=True))
    expected = ["out", "grad_q", "grad_k", "grad_v"]
    result = parity.check_path(outputs, oracles, baselines, list(ATTENTION_CASES), lambda _: p.contract, expected)
    assert result["verdict"] == "pass", result["failed_cases"]
    assert set(result["worst"]) == set(expected)
    assert all(entry["bound_ratio"] < 0.5 for entry in result["worst"].values())
    # causal dQ of query 0 is exactly zero in the oracle: its row passes on the gradient floor
    zero_row = [r for r in result["cases"] if r["case"] == "mha-causal-S256" and r["output"] == "grad_q"][0]
    assert oracles[0]["grad_q"][0, 0, 0].abs().max() == 0 and zero_row["verdict"] == "pass"


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_torch_matmul_against_the_reference_passes(name):
    dtype, gen = DTYPES[name], torch.Generator().manual_seed(3)
    a, b, grad_out = (torch.randn(*size, generator=gen).to(dtype) for size in ((41, 33), (33, 77), (41, 77)))

    def run(fn, dt):  # the oracle: the same (rounded) inputs, upcast
        x, y = a.to(dt).requires_grad_(), b.to(dt).requires_grad_()
        out = fn(x, y)
        grad_a, grad_b = torch.autograd.grad(out, [x, y], grad_out.to(dt))
        return {"out": out.detach(), "grad_a": grad_a, "grad_b": grad_b}

    result = parity.check_path([run(torch.matmul, dtype)], [run(matmul_reference.matmul, torch.float64)],
                               [run(matmul_reference.matmul, dtype)], ["41x77x33"], lambda _: precision(name).contract,
                               ["out", "grad_a", "grad_b"])
    assert result["verdict"] == "pass", result["failed_cases"]
    assert result["worst"]["out"]["rows"] == 41


# --- the logsumexp's own, fp32-level contract ------------------------------------------------

def _lse_case(dtype, seq_len=128, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, seq_len, head_dim, generator=gen).to(dtype) for _ in range(3))
    oracle = attention_reference.attention_logsumexp(q.double(), k.double(), causal=True)
    baseline = attention_reference.attention_logsumexp(q.float(), k.float(), causal=True)  # fp32 from the upcast inputs
    return q, k, v, oracle, baseline


def test_triton_logsumexp_passes_and_1e_3_off_fails_at_bf16():
    from posttrainllm.ops.attention.kernels import triton_attention

    q, k, v, oracle, baseline = _lse_case(torch.bfloat16)
    _, lse = triton_attention(q, k, v, causal=True, block_q=32, block_kv=32)  # fp32-accumulated
    p = precision("bf16")
    good = parity.check_output(lse, oracle, baseline, p.lse_contract, row_ndim=0)
    assert good["verdict"] == "pass", good["reason"]
    off = parity.check_output(lse + 1e-3, oracle, baseline, p.lse_contract, row_ndim=0)
    assert off["verdict"] == "fail" and "max_abs_err 0.001 > allowed" in off["reason"]
    assert len(off["worst_row"]["index"]) == 3  # (b, h, s): each element is its own row
    # the blind spot this closes: held to the bf16 output's contract, the same error passes
    assert parity.check_output(lse + 1e-3, oracle, baseline, p.contract, row_ndim=0)["verdict"] == "pass"


def _online_logsumexp(q, k, block=64):
    """Flash-style fp32 logsumexp: scores in base 2 with log2(e) folded into the scale, running max and sum."""
    q, k = q.float(), k.float()
    seq_len, scale = q.shape[2], 1.0 / math.sqrt(q.shape[3]) * math.log2(math.e)
    m = torch.full(q.shape[:3], float("-inf"))
    total = torch.zeros(q.shape[:3])
    rows = torch.arange(seq_len)[:, None]
    for start in range(0, seq_len, block):
        s = (q @ k[:, :, start:start + block].transpose(-2, -1)) * scale
        s = s.masked_fill(rows < torch.arange(start, min(start + block, seq_len))[None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        total = total * torch.exp2(m - m_new) + torch.exp2(s - m_new[..., None]).sum(-1)
        m = m_new
    return (m + torch.log2(total)) * math.log(2.0)


def test_long_sequence_online_logsumexp_passes_and_1e_3_off_fails(long_attention):
    case = long_attention("bf16", 1)
    q, k = case["q"], case["k"]
    oracle = attention_reference.attention_logsumexp(q.double(), k.double(), causal=True)
    baseline = attention_reference.attention_logsumexp(q.float(), k.float(), causal=True)
    lse, contract = _online_logsumexp(q, k), precision("bf16").lse_contract
    assert parity.check_output(lse, oracle, baseline, contract, row_ndim=0)["verdict"] == "pass"
    off = lse.clone()
    off[0, 1, 1234] += 1e-3  # one element
    check = parity.check_output(off, oracle, baseline, contract, row_ndim=0)
    assert check["verdict"] == "fail" and check["worst_row"]["index"] == (0, 1, 1234)


# --- check_path: missing outputs, missing cases, each output's own contract -------------------

def _tiny_case(scale=1.0):
    oracle = {"out": torch.full((2, 3), scale, dtype=torch.float64), "lse": torch.full((1, 2, 2), 2.0, dtype=torch.float64)}
    return oracle, {key: value.float() for key, value in oracle.items()}


def test_check_path_fails_a_missing_output_naming_it():
    oracle, exact = _tiny_case()
    result = parity.check_path([{"out": exact["out"]}], [oracle], [exact], ["S2"], lambda _: Contract(), ["out", "lse"])
    assert result["verdict"] == "fail"
    assert result["failed_cases"] == ["S2/lse: missing output: the path did not produce it"]


def test_check_path_fails_a_missing_case_naming_it():
    oracle, exact = _tiny_case()
    result = parity.check_path([exact], [oracle, oracle], [exact, exact], ["S2-seed0", "S2-seed1"],
                               lambda _: Contract(), ["out", "lse"])
    assert result["verdict"] == "fail"
    assert result["failed_cases"] == ["S2-seed1/*: no result for this case"]
    surplus = parity.check_path([exact, exact], [oracle], [exact], ["S2"], lambda _: Contract(), ["out"])
    assert surplus["verdict"] == "fail" and surplus["failed_cases"][0].startswith("*/*: 2 results for 1 cases")


def test_check_path_fails_a_path_that_did_not_run():
    oracle, exact = _tiny_case()
    result = parity.check_path(None, [oracle, oracle], [exact, exact], ["a", "b"], lambda _: Contract(), ["out"])
    assert result["verdict"] == "fail"
    assert result["failed_cases"] == ["a/*: no result: the path did not run", "b/*: no result: the path did not run"]
    with pytest.raises(ValueError, match="one of each per case"):
        parity.check_path([exact], [oracle], [], ["a"], lambda _: Contract(), ["out"])


def test_check_path_gives_each_output_its_own_contract():
    oracle, exact = _tiny_case()
    got = {"out": exact["out"], "lse": exact["lse"] + 1e-3, "extra": torch.zeros(1)}
    loose, tight = Contract(floor_rel=1e-2, atol=1e-2, rtol=1e-2), Contract(floor_rel=1e-5)
    asked = []

    def contract_for(name):
        asked.append(name)
        return tight if name == "lse" else loose

    result = parity.check_path([got], [oracle], [exact], ["S2"], contract_for, ["out", "lse"])
    assert sorted(asked) == ["lse", "out"]
    assert result["verdict"] == "fail"
    assert [f.split(":")[0] for f in result["failed_cases"]] == ["S2/lse"]
    assert result["worst"]["lse"]["row_ndim"] == 0 and len(result["worst"]["lse"]["worst_row"]["index"]) == 3
    assert result["worst"]["out"]["verdict"] == "pass"
    assert result["unchecked_outputs"] == ["extra"]
    rows = parity.check_path([got], [oracle], [exact], ["S2"], lambda _: loose, ["lse"], row_ndim={"lse": 1})
    assert rows["worst"]["lse"]["row_ndim"] == 1 and len(rows["worst"]["lse"]["worst_row"]["index"]) == 2


def test_check_path_keeps_the_forward_scale_for_an_exactly_zero_gradient():
    oracle = {"out": torch.full((2,), 3.0, dtype=torch.float64), "grad_q": torch.zeros(2, dtype=torch.float64)}
    got = {"grad_q": torch.tensor([2e-7, 0.0])}
    contract = Contract(error_multiple=8.0, floor_rel=1e-6)
    result = parity.check_path([got], [oracle], [{"grad_q": torch.zeros(2)}], ["S1"], lambda _: contract, ["grad_q"])
    assert result["verdict"] == "pass"
    assert result["worst"]["grad_q"]["allowed_abs_err"] == pytest.approx(3e-6)


def test_the_fp32_elementwise_count_scales_with_the_tensor_and_still_bites():
    """fp32 BLAS over K=512 leaves ~5e-7 x max|C| of rounding on every element, near-zero ones included: with
    atol/rtol alone (1e-5) the plain `a @ b` itself misses the count, so torch.matmul, the same call, failed the
    curve's check. atol_rel (conf/precision/fp32.yaml) scales the elementwise tolerance with the tensor; an
    element off by 3x that tolerance still fails the count."""
    import dataclasses

    contract = precision("fp32").contract
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=gen), torch.randn(512, 512, generator=gen)
    oracle, got = a.double() @ b.double(), torch.matmul(a, b)
    baseline = a @ b
    assert parity.check_output(got, oracle, baseline, contract)["verdict"] == "pass"
    without = parity.check_output(got, oracle, baseline, dataclasses.replace(contract, atol_rel=0.0))
    assert without["verdict"] == "fail" and "mismatch_frac" in without["reason"]
    wrong = got.clone()
    i = oracle.abs().argmin()  # a near-zero element: only the absolute part of the tolerance covers it
    wrong.view(-1)[i] += 3 * contract.atol_rel * oracle.abs().max().item()
    broken = parity.check_output(wrong, oracle, baseline, contract)
    assert broken["verdict"] == "fail" and "mismatch_frac" in broken["reason"]
