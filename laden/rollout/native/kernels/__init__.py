"""laden's Triton kernels of the native engine's decode step: paged attention (`triton_decode`), the
split-K linear (`triton_linear`), the q/k norm + rotary + cache write (`triton_qkv`), the fused
sampler (`triton_sampler`) and SwiGLU (`triton_swiglu`); their launch settings are one value,
`KernelOptions` (`options`, importable without Triton)."""
