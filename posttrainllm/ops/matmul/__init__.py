"""The matmul op: reference.py (readable math), kernels.py (Triton, loaded lazily), definition.py (its OpDef)."""

from posttrainllm.ops.matmul.definition import OP

__all__ = ["OP"]

# What the lab's stages read of this op beyond its own code (lab/reads.py `op_reads`; a literal, read without
# importing the op): code it borrows from the attention op's kernels: the launch geometry (the kernel stage) reads
# its AUTO_CPU_NOTE (definition.py), and the autotuner (tile or workgroup auto) its shared-memory limit (kernels.py)
READS = {"reads": ({"stages": ("kernel",), "code": ("posttrainllm/ops/attention/kernels.py",)},
                   {"stages": ("microbench", "bench_train"), "when": {"config.tile.name": "auto"},
                    "code": ("posttrainllm/ops/attention/kernels.py",)},
                   {"stages": ("microbench", "bench_train"), "when": {"config.workgroup.name": "auto"},
                    "code": ("posttrainllm/ops/attention/kernels.py",)})}
