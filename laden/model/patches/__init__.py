"""Patches on Hugging Face modules that change what they keep for backward or how they compute,
never what they return: lean RMSNorms and gated MLPs, fused elementwise kernels, rotary
embeddings, gradient sinks, tiled MLPs and compiled layers. Each is applied per model
(`laden.model.patches.apply`), with its options stored on the patched modules."""
