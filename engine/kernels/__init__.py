"""CPU kernels of the local engine: GEMM, packed-weight panels, decode attention, threads."""
