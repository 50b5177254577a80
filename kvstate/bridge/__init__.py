"""mlx-lm models on kvstate records: the cache shells a model reads, the eager
forward, the compiled decoder, hybrid layers and prompt-cache conversion.
The public face is ``kvstate.mlx_lm``.

Imports: ``kvstate.batch`` and the floors beneath it. Design: ``notes/bridge.md``.
"""
