"""Determinism and batch invariance of every built-in path of every op, at the tiny shape in fp32 on this machine
(lab/invariance.py's checks, as the kernel stage runs them, without the other stages): one line per path.

    TRITON_INTERPRET=1 python scripts/bitwise-today.py     # on a CPU (Triton through its interpreter)
    python scripts/bitwise-today.py device=cuda             # on a GPU: the same checks
"""
import sys
import time

import torch

from posttrainllm.lab import invariance, oracle
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import case_config, get_op

for name in ["attention", "decode_attention", "matmul", "moe", "rmsnorm", "rope", "swiglu", "cross_entropy"]:
    cfg = load([f"op={name}", "device=cpu", "shape=tiny", "precision=fp32", "parity.seeds=[0]", *sys.argv[1:]])
    op, case = get_op(name), get_op(name).cases(cfg)[0]
    device = cfg.device.name
    inputs = op.make_inputs(case, torch.float32, device)
    ccfg = case_config(case, cfg)
    grad_out = oracle.upstream_gradient(case, op.reference.fn(inputs, ccfg)["out"].detach())
    record = {"case": case.__dict__, "inputs": inputs, "grad_out": grad_out}
    for impl in op.optimized(cfg):
        t = time.perf_counter()
        first = invariance.run_once(impl, inputs, grad_out if impl.checks_gradients else None, ccfg, device)
        m = invariance.measure(op, impl, record, first, ccfg, device)
        d, b = m["determinism"], m["batch_invariance"]
        bad = {k: v["first_differing_row"] for k, v in b.get("outputs", {}).items() if not v["bitwise_equal"]}
        print(f"{name:16s} {impl.name:12s} {op.problem(case):40s} det={d.get('bitwise_equal')} "
              f"bi={b.get('bitwise_equal')} sizes={b.get('batch_sizes')} {time.perf_counter() - t:.1f}s "
              f"{'; '.join(f'{k}: {v}' for k, v in bad.items())[:200]}", flush=True)
