"""quantkit: INT4 quantization (GPTQ, AWQ), W4A16 kernels, eval and serving for Hugging Face LLMs."""

__version__ = "0.1.0"
