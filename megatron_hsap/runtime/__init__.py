"""Execution of compiled plans with torch: kernels, LSE merge, P2P rounds, autograd."""
