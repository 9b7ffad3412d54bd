"""Graph backends: CUDA graphs and the CPU tape, behind one protocol."""
