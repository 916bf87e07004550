"""The MLX engine: ``tokentrace engine`` (an instrumented, OpenAI-compatible mlx-lm server), its
scheduler and prompt cache, and the Python API for applications that embed mlx-lm themselves."""
