"""The cross_entropy op: reference.py (readable math), kernels.py (Triton, loaded lazily), definition.py (its OpDef)."""

from posttrainllm.ops.cross_entropy.definition import OP

__all__ = ["OP"]

# What the lab's stages read of this op beyond its definition (lab/reads.py `op_reads`; a literal, read without
# importing the op): a parity case at bench-train's shape (train.batch_size x train.seq_len), so the stages that
# list the cases read train's
READS = {"reads": ({"stages": ("reference", "microbench"), "params": ("config.train.batch_size",
                                                                       "config.train.seq_len")},)}
