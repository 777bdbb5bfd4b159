"""Integrations of gockpt into training frameworks: ``gockpt.integrations.deepspeed``, ``.lightning``, ``.transformers``."""
