"""The moe op: reference.py (readable math), kernels.py (Triton, loaded lazily), definition.py (its OpDef)."""

from posttrainllm.ops.moe.definition import OP

__all__ = ["OP"]

# What the lab's stages read of this op beyond its definition (lab/reads.py `op_reads`; a literal, read without
# importing the op): whether its grouped_mm path runs (which paths the point has: every stage that lists them) is
# probed on a problem of the point's shape.ops.moe.d_model x shape.ops.moe.ffn (definition.py); the kernel stage
# reads the whole shape
READS = {"reads": ({"stages": ("parity", "bench_train"), "params": ("config.shape.ops.moe.d_model",
                                                                     "config.shape.ops.moe.ffn")},)}
