"""op=problem: an op made from a problem file in KernelBench's format (definition.py; docs/bring-your-own-op.md)."""

from posttrainllm.ops.problem.definition import problem_op

__all__ = ["problem_op"]
