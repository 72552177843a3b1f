"""megatron-hsap sim package."""
