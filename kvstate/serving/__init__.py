"""Continuous batching and the HTTP API on top of it: the scheduler and its
engines, the prefix cache, the OpenAI-compatible server.

Imports: every floor beneath ``kvstate.cli``. Design: ``notes/serving.md``.
"""
