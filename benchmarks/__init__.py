"""kvstate's benchmarks: ``python -m benchmarks`` lists them, ``python -m benchmarks NAME
[args]`` runs one. Shared helpers: ``benchmarks._common``. Figures and the commands
that measure them: ``notes/figures.md``."""
