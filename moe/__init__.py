"""The MoE runner users call (in progress)."""
