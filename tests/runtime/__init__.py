"""Runtime tests (torch, gloo ranks)."""
