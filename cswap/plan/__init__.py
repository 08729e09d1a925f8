"""Planning: the tensor profiler, the advisor and its timeline model, decision checks, and the per-epoch loop."""
