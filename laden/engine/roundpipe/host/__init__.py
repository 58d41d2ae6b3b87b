"""Host state of the roundpipe engine: where every parameter's weights, master weights and
gradients live (`layout`, `store`), the host threads that land gradients and run updates
(`jobs`), how many bytes each mode holds (`memory`), and the store under Hugging Face names
(`hf_state`: weights one tensor at a time, the checkpoint's model part)."""
