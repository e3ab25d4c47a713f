"""posttrainllm: a kernel parity and speed lab for LLM kernels."""

__version__ = "0.1.0"
