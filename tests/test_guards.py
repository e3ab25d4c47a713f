"""run_guarded: a path must not change its inputs, alias them, or skip its Triton kernel."""

import pytest
import torch

from posttrainllm.lab.isolation.guards import count_triton_launches, run_guarded


@pytest.fixture
def inputs() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(16, 24), "b": torch.randn(24, 8)}


def test_fresh_output_passes(inputs):
    outputs, violations = run_guarded(lambda: {"out": inputs["a"] @ inputs["b"]}, inputs, expect_triton=False)
    assert violations == []
    torch.testing.assert_close(outputs["out"], inputs["a"] @ inputs["b"])


def test_in_place_mutation_is_caught(inputs):
    def mutates():
        inputs["a"].mul_(2.0)
        return {"out": inputs["a"] @ inputs["b"]}

    _, violations = run_guarded(mutates, inputs, expect_triton=False)
    assert violations == ["changed input a"]


def test_single_element_and_nan_bit_changes_are_caught():
    x = torch.tensor([1.0, float("nan"), 0.0])
    same_nan = {"x": x}
    assert run_guarded(lambda: {"out": x + 1}, same_nan, expect_triton=False)[1] == []  # NaN == NaN bitwise

    def flips_sign_of_zero():
        x[2] = -0.0  # equal as a number, different bits
        return {"out": x + 1}

    assert run_guarded(flips_sign_of_zero, same_nan, expect_triton=False)[1] == ["changed input x"]


def test_returning_the_input_itself_is_caught(inputs):
    _, violations = run_guarded(lambda: {"out": inputs["a"]}, inputs, expect_triton=False)
    assert violations == ["output out shares storage with input a"]


def test_returning_a_transposed_view_is_caught(inputs):
    _, violations = run_guarded(lambda: {"out": inputs["b"].t(), "other": inputs["a"] @ inputs["b"]},
                                inputs, expect_triton=False)
    assert violations == ["output out shares storage with input b"]


def test_a_path_that_raises_is_reported_not_raised(inputs):
    def broken():
        raise RuntimeError("kernel failed to compile\nlong trace")

    outputs, violations = run_guarded(broken, inputs, expect_triton=True)
    assert outputs is None
    assert violations == ["raised RuntimeError: kernel failed to compile"]


def test_triton_matmul_counts_its_launch():
    from posttrainllm.ops.matmul.kernels import triton_matmul

    a, b = torch.randn(20, 16), torch.randn(16, 24)
    with count_triton_launches() as launches:
        triton_matmul(a, b, block_m=16, block_n=16, block_k=16)
    # exactly one: the interpreter does not call Triton's launch hook, so the two mechanisms never double count
    assert launches.total == 1
    assert launches.by_kernel == {"_matmul_kernel": 1}
    outputs, violations = run_guarded(lambda: {"out": triton_matmul(a, b, block_m=16, block_n=16, block_k=16)},
                                      {"a": a, "b": b}, expect_triton=True)
    assert violations == []
    torch.testing.assert_close(outputs["out"], a @ b, rtol=1e-5, atol=1e-5)


def test_torch_matmul_launches_no_triton_kernel(inputs):
    _, violations = run_guarded(lambda: {"out": torch.matmul(inputs["a"], inputs["b"])}, inputs, expect_triton=True)
    assert violations == ["launched no Triton kernel"]


def test_counters_nest_and_restore_what_they_patch():
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from posttrainllm.ops.matmul.kernels import triton_matmul

    run_before, hooks_before = InterpretedFunction.run, list(triton.knobs.runtime.launch_enter_hook.calls)
    a = torch.randn(16, 16)
    with pytest.raises(ValueError, match="boom"):
        with count_triton_launches() as outer:
            triton_matmul(a, a, block_m=16, block_n=16, block_k=16)
            with count_triton_launches() as inner:
                triton_matmul(a, a, block_m=16, block_n=16, block_k=16)
            raise ValueError("boom")
    assert (outer.total, inner.total) == (2, 1)
    assert InterpretedFunction.run is run_before
    assert triton.knobs.runtime.launch_enter_hook.calls == hooks_before
    with count_triton_launches() as after:
        pass
    triton_matmul(a, a, block_m=16, block_n=16, block_k=16)  # outside any counter: counted by none
    assert after.total == 0


class _Metadata:
    """What a compiled launch passes its launch hook: Triton's LazyDict, whose plain data holds the name."""

    def __init__(self, name: str) -> None:
        self.data = {"name": name, "function": None, "stream": 0}


def test_compiled_launch_hook_counts_by_kernel_name():
    """The GPU path without a GPU: call the hook the way a compiled launch does (HookChain, triton >= 3.5)."""
    import triton

    with count_triton_launches() as launches:
        triton.knobs.runtime.launch_enter_hook(_Metadata("_attn_fwd_kernel"))
        triton.knobs.runtime.launch_enter_hook(None)  # triton skips the metadata when no hook wants it
    assert launches.total == 2 and launches.by_kernel == {"_attn_fwd_kernel": 1, "<unknown>": 1}


@pytest.mark.parametrize("previous", [None, "a hook"])
def test_a_single_attribute_launch_hook_is_chained_and_restored(monkeypatch, previous):
    """triton 3.4 kept one callable (or None) in knobs.runtime.launch_enter_hook, not a HookChain: ours runs
    first, then the one that was there, which is put back when the last counter closes."""
    import triton

    seen = []
    hook = (lambda metadata: seen.append(metadata.data["name"])) if previous else None
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
    with count_triton_launches() as launches:
        assert triton.knobs.runtime.launch_enter_hook is not hook
        triton.knobs.runtime.launch_enter_hook(_Metadata("_matmul_kernel"))
    assert launches.by_kernel == {"_matmul_kernel": 1}
    assert seen == (["_matmul_kernel"] if previous else [])
    assert triton.knobs.runtime.launch_enter_hook is hook
