"""Integrations of gockpt with training frameworks (installed as ``gockpt.integrations``).

The DeepSpeed engine integration is planned (see DESIGN.md section 7); the replay adapters,
gradient records and per-rank storage parts are shaped for it.
"""
