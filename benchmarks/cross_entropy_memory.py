"""Peak allocation bytes of the cross_entropy paths at a 32k vocabulary, as the microbench measures them."""
import os
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from posttrainllm.lab import oracle, runner
from posttrainllm.lab.configure import load
from posttrainllm.measure.memory import peak_bytes
from posttrainllm.ops.registry import get_op

cfg = load(["op=cross_entropy", "device=cpu", "shape.ops.cross_entropy.vocab=32768",
            "shape.ops.cross_entropy.d_model=32", "op.chunk_size=8",
            "op.block_v=8192"])
op = get_op("cross_entropy")
case = next(c for c in op.cases(cfg) if c.main)
print(op.problem(case))
x = op.make_inputs(case, torch.float32, "cpu")
g = oracle.upstream_gradient(case, op.reference.fn(x, cfg)["out"])
for name, impl in op.paths(cfg).items():
    with torch.no_grad():
        f = peak_bytes(lambda: impl.fn(x, cfg), "cpu", warmup=0)["peak_bytes"]
    t = peak_bytes(runner.runner_for(impl).forward_backward(x, g, cfg), "cpu", warmup=0)["peak_bytes"]
    print(f"{name:10s} forward {f:>12,} B   forward+backward {t:>12,} B")
