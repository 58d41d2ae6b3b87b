"""Data parallel roundpipe over gloo: two replicas on halves of a batch == one process on all of it.

Two CPU processes (`tests/support/workers.py`) train the engine and the library API on
their half of each step's micro-batches; their host gradients are all-reduced before the
update. The single-process run on the whole batch is the reference.
"""

from __future__ import annotations

import torch
from roundpipe_cases import make_steps, mlp, settings, tied_model
from workers import run_workers

from laden import RoundPipe, RoundPipeRunConfig
from laden.engine.roundpipe import RoundPipeEngine

WORLD = 2
NUM_STEPS = 2


def mlp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(NUM_STEPS)]


def train(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """Both front-ends for NUM_STEPS steps on this rank's share (everything when world == 1)."""
    engine = RoundPipeEngine(tied_model(), optim=settings(gradient_clipping=0.5), compute_dtype=torch.float32,
                             model_memory_limit=0.01)  # fmt: skip
    for mbs in make_steps(NUM_STEPS):
        engine.train_batch(mbs[rank::world], global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
    rp = RoundPipe(mlp())  # grad_reduce="mean": each replica's loss is its local mean
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
    for x, y in mlp_batches():
        share = slice(rank * 8 // world, (rank + 1) * 8 // world)
        rp.forward_backward(input_args=(x[share],), label=y[share], loss_fn=lambda o, t: ((o - t) ** 2).mean(),
                            run_config=RoundPipeRunConfig(num_microbatch=2))  # fmt: skip
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    return {"engine": engine.state_dict()["model"], "library": dict(rp.model.state_dict())}


def test_two_replicas_equal_one_process():
    replicas = run_workers(train, WORLD)  # one thread and a gloo group on each
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = train(0, 1)
    finally:
        torch.set_num_threads(before)
    for rank, replica in enumerate(replicas):
        for part in ("engine", "library"):
            for name, t in single[part].items():
                torch.testing.assert_close(replica[part][name], t, msg=f"rank {rank} {part} {name}")
