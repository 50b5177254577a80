"""One module per record kind (dense, quantized, rotating, chunked, recurrent,
composite, shared) and the row machinery the padded kinds share (``rows``).
Each kind registers its implementation of every generic operation.

Imports: ``kvstate.core``, ``kvstate.compiled``, ``kvstate.kernels``. Design: ``notes/kinds.md``.
"""
