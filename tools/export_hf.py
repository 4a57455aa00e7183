"""Export a GGUF model (default: the embedded SmolLM2-135M-Instruct) as a Hugging Face llama directory.

    python tools/export_hf.py --out /tmp/smollm2-hf [--model file.gguf] [--dtype bfloat16]

Why: vLLM and transformers need an HF directory to run the same weights jaxserve runs. Weights go
through jaxserve's own GGUF reader (jaxserve/model/gguf_loader.py: dequantized, llama.cpp's q/k
permutation undone), so the export's float32 forward equals jaxserve's.

Written: config.json (legacy `rope_theta`/`rope_scaling`, read by vLLM and transformers 4, plus
transformers 5's `rope_parameters`; `torch_dtype` and `dtype`), model.safetensors, the tokenizer
jaxserve rebuilds from GGUF metadata (tokenizer.json, tokenizer_config.json, chat template) and
generation_config.json with the special-token ids.

A tied embedding is stored as `model.embed_tokens.weight` only. (An earlier export saved it under
`lm_head.weight` alone, as `safetensors.torch.save_model` picks one name for shared tensors; vLLM
skips `lm_head.weight` as an alias of the tied embedding and so never loaded the embedding.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

DTYPES = ("bfloat16", "float16", "float32")


def hf_config(gguf_cfg: dict, dtype: str) -> dict:
    """config.json for both transformers 4/vLLM (rope_theta, rope_scaling) and 5 (rope_parameters)."""
    cfg = dict(gguf_cfg)
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    rope.update(cfg.get("rope_scaling") or {})
    cfg["rope_parameters"] = rope
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    return cfg


def export_hf(model: str | None, out: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `model` (a .gguf path, or None for the default model) to `out` as an HF directory."""
    import torch
    from safetensors.torch import save_file

    from jaxserve.errors import UserError
    from jaxserve.model.gguf_loader import load_gguf
    from jaxserve.model.loader import resolve_model_path
    from jaxserve.tokenizer import Tokenizer

    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}.", param="dtype")
    path = resolve_model_path(model)
    if not (path.is_file() and path.suffix == ".gguf"):
        raise UserError(f"{str(path)!r} is not a .gguf file: only GGUF models are exported "
                        "(an HF directory already is one).", param="model")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, weights = load_gguf(path)
    if cfg["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    torch_dtype = getattr(torch, dtype)
    tensors = {name: torch.from_numpy(np.array(w, np.float32)).to(torch_dtype)
               for name, w in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    tok = Tokenizer.from_gguf(path)
    tok.hf.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    eos = sorted(tok.eos_token_ids)
    gen = {"bos_token_id": cfg.get("bos_token_id"), "pad_token_id": cfg.get("pad_token_id"),
           "eos_token_id": eos[0] if len(eos) == 1 else eos}
    gen = {k: v for k, v in gen.items() if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded default model)")
    ap.add_argument("--out", required=True, help="directory to write")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="stored weight dtype")
    args = ap.parse_args(argv)
    print(export_hf(args.model, args.out, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
