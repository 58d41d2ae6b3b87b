"""Host state of the roundpipe engine: where every parameter's weights, master weights and
gradients live (`layout`, `store`), the host threads that land gradients and run updates
(`jobs`), and how many bytes each mode holds (`memory`)."""
