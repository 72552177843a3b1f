"""Megatron-core integration tests."""
