"""op=problem: an op made from a problem file in KernelBench's format (definition.py; docs/bring-your-own-op.md)."""

from posttrainllm.ops.problem.definition import problem_op

__all__ = ["problem_op"]

# What the lab's stages read of this op (lab/reads.py `op_reads`; a literal, read without importing the op): it is
# made per point from its file at the point's seeds and device (definition.py), in every stage; it has no Triton
# code of its own, and is no package of the registry's (its folder is named here)
READS = {"triton": False,
         "reads": ({"code": ("posttrainllm/ops/problem",), "code_at": ("config.op.file",),
                    "params": ("config.parity.seeds", "config.device.name")},)}
