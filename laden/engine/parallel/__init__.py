"""What several train engines borrow: process groups, context, tensor and vocabulary parallelism, offload.

One concept per module, used by the `fsdp` and the `archon` engines alike (as torchtitan's
`distributed/`); nothing here knows an engine:

- `launch`: `torch.distributed` started from torchrun's environment, the `(dp, cp, tp)` mesh;
- `ulysses`: Ulysses context parallel (a packed row sliced over ranks, all-to-alls around attention);
- `parallelize`: tensor-parallel plans of a Hugging Face decoder and its FSDP2 sharding;
- `vocab_parallel`: the chunked cross-entropy over a head split on the vocabulary;
- `objective`: an objective (or `forward`'s per-token outputs) on a possibly split head;
- `padding`: the padding micro-batches that keep ranks' collectives matched;
- `params`: parameters cast to their storage dtype, a DTensor's local shard, a rank's slice of a full tensor;
- `offload`: device storages parked in host memory and restored in place.
"""
