"""Whose backward a path ran, and the guards around that backward call.

parity.json says, per path, `"backward": "own" | "<another path>" | "none"`; a borrowed backward's
gradients are never counted as a pass of the path. The kernel stage guards the gradients' call as it
guards the forward (inputs unchanged, no aliasing) and requires the kernels the path names for each
direction, so a path that launches one helper kernel, or runs its backward in PyTorch, is caught.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import parity_report

from posttrainllm.lab.configure import load
from posttrainllm.lab.isolation.guards import run_guarded
from posttrainllm.ops.attention import definition as attention
from posttrainllm.ops.decode_attention import definition as decode_attention
from posttrainllm.ops.matmul import definition as matmul
from posttrainllm.track.report import point_table

ATTENTION = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]"]
DECODE = ["op=decode_attention", "device=cpu", "parity.seeds=[0]", "shape.ops.decode_attention.kv_lens=[1,40]",
          "shape.ops.decode_attention.q_lens=[1,5]", "shape.ops.decode_attention.kv_len=64"]


def test_a_borrowed_backward_is_shown_as_not_checked(tmp_path):
    report = parity_report(load([*DECODE, "op.only=[triton,sdpa]"]), tmp_path)
    triton, sdpa = report["paths"]["triton"], report["paths"]["sdpa"]
    assert triton["backward"] == "reference" and sdpa["backward"] == "own"
    assert triton["gradients"].startswith("not checked: the backward is borrowed from the 'reference' path")
    # its gradients are not judged (neither passed nor failed) as the kernel's: only the forward output is
    assert set(triton["worst"]) == {"out"}
    assert {c["output"] for c in triton["cases"]} == {"out"}
    assert {"out", "grad_q", "grad_k", "grad_v"} <= set(sdpa["worst"])
    assert "backward_rule" in report
    receipt = {"point": "p", "parity": report, "microbench": {"paths": {}},
               "config": {"precision": {"name": "fp32"}},
               "provenance": {"machine": {"device_name": "cpu", "threads": 1}}}
    assert "gradients not checked: reference's backward" in point_table(receipt)


def test_a_forward_only_path_gets_no_gradients_asked(tmp_path, monkeypatch):
    sdpa = attention.IMPLS["sdpa"]

    def no_grad_sdpa(x, cfg):
        with torch.no_grad():
            return sdpa.fn(x, cfg)

    monkeypatch.setitem(attention.IMPLS, "sdpa", dataclasses.replace(sdpa, fn=no_grad_sdpa, backward="none"))
    report = parity_report(load([*ATTENTION, "op.only=[sdpa]"]), tmp_path)
    path = report["paths"]["sdpa"]
    assert path["verdict"] == "pass" and path["backward"] == "none"
    assert path["gradients"].startswith("none: a forward-only path")
    assert set(path["worst"]) == {"out"}


def test_a_backward_that_writes_into_its_inputs_is_caught(tmp_path, monkeypatch):
    """The forward is clean; the backward scribbles on q's storage. Only a guard around the backward sees it."""
    sdpa = attention.IMPLS["sdpa"]

    class Scribbles(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        @staticmethod
        def backward(ctx, do):
            q, k, v = ctx.saved_tensors
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                grads = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves, do)
            q.mul_(1.0 + 1e-3)  # damage the caller's tensor after computing the right answer
            return grads

    def fn(x, cfg):
        return {"out": Scribbles.apply(x["q"], x["k"], x["v"])}

    monkeypatch.setitem(attention.IMPLS, "sdpa", dataclasses.replace(sdpa, fn=fn))
    report = parity_report(load(ATTENTION + ["architecture=mha", "op.only=[sdpa]"]), tmp_path)
    failures = report["paths"]["sdpa"]["failed_cases"]
    assert report["paths"]["sdpa"]["verdict"] == "fail"
    assert any("backward changed input q" in f for f in failures)
    assert not any(": changed input q" in f for f in failures)  # the forward call itself was clean


def test_a_triton_path_whose_backward_falls_back_to_pytorch_is_caught(tmp_path, monkeypatch):
    """Forward values from the Triton kernel, gradients from SDPA's backward: numerically right, wrong code."""
    triton = attention.IMPLS["triton"]

    def fn(x, cfg):
        got = triton.fn({k: t.detach() for k, t in x.items()}, cfg)
        ref = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)
        return {"out": ref + (got["out"] - ref).detach(), "lse": got["lse"]}

    monkeypatch.setitem(attention.IMPLS, "triton", dataclasses.replace(triton, fn=fn))
    report = parity_report(load(ATTENTION + ["architecture=mha", "op.only=[triton]"]), tmp_path)
    failures = report["paths"]["triton"]["failed_cases"]
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert any("backward launched no _attn_bwd_dq (a kernel the path names)" in f for f in failures)
    assert not any(f.split(": ", 1)[1].startswith("launched no") for f in failures)  # the forward launched it


def test_one_helper_launch_is_not_proof_of_the_named_kernels():
    """A path that launches only a helper kernel (MoE's un-permute, say) does not pass the launch proof."""
    from posttrainllm.ops.matmul.kernels import triton_matmul

    a, b = torch.randn(20, 16), torch.randn(16, 24)
    _, violations = run_guarded(lambda: {"out": triton_matmul(a, b, block_m=16, block_n=16, block_k=16)},
                                {"a": a, "b": b}, expect_triton=True, kernels=("_gate_up_kernel", "_matmul_kernel"))
    assert violations == ["launched no _gate_up_kernel (a kernel the path names)"]


@pytest.mark.parametrize("registry", [attention.IMPLS, matmul.IMPLS, decode_attention.IMPLS])
def test_every_triton_path_names_its_kernels_for_each_direction_it_claims(registry):
    triton = registry["triton"]
    assert triton.kernels.get("forward")
    assert bool(triton.kernels.get("backward")) == triton.checks_gradients
