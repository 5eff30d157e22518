"""Megatron-Core glue around the experts: layer specs (`specs`), the MoE layer with the FP32
top-k combine (`moe_layer`), model builders (`model`), conversion of built models (`convert`),
upcycling (`upcycling`) and the frozen-input guard for recompute (`recompute`)."""
