"""The GK (giga-kernel) decode path: attention control, the fused whole-stack program, the GK model."""
