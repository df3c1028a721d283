"""Write tests/golden/hf/<family>/hidden.json: transformers' `output_hidden_states` for the committed
tiny model of each family (tests/golden/hf/<family>/, made by make_hf_golden.py) on its golden
input ids, in the dtype its golden logits were computed in. tests/test_forward_batch.py compares specrs' hidden-state taps with them: entry i < L
is the residual stream after i blocks (specrs' layer i), entry L is after the final norm (specrs'
"final_norm"). The script also checks that this transformers still computes the committed golden
logits, so the two files describe one model.

Needs torch and transformers (not installed by the Makefile; the files are committed):
    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers tokenizers
    /tmp/hf/bin/python scripts/make_hf_hidden_golden.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "hf"


def main() -> None:
    for family_dir in sorted(p for p in GOLDEN.iterdir() if p.is_dir()):
        golden = json.loads((family_dir / "golden.json").read_text())
        # The dtype make_hf_golden.py ran the model in (qwen2's is stored and run in bfloat16).
        dtype = getattr(torch, golden["dtype"])
        model = transformers.AutoModelForCausalLM.from_pretrained(family_dir, dtype=dtype).eval()
        ids = torch.tensor([golden["input_ids"]])
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        logits = out.logits[0].float().numpy()
        drift = float(np.abs(logits - np.array(golden["logits"], dtype=np.float32)).max())
        # float32 must agree to rounding; bfloat16 to a few bf16 steps of the largest logit (qwen2:
        # 0.125 at |logit| <= 8, 2 steps, from a different torch than the one that wrote golden.json).
        bound = 1e-4 if dtype == torch.float32 else 0.03 * float(np.abs(logits).max())
        assert drift < bound, f"{family_dir.name}: transformers {transformers.__version__} moved the golden logits by {drift}"
        hidden = [h[0].float().numpy().round(6).tolist() for h in out.hidden_states]
        (family_dir / "hidden.json").write_text(
            json.dumps(
                {
                    "reference": f"transformers {transformers.__version__} output_hidden_states",
                    "dtype": golden["dtype"],
                    "input_ids": golden["input_ids"],
                    "hidden_states": hidden,
                }
            )
        )
        print(f"{family_dir.name}: {len(hidden)} hidden states, golden logits reproduced within {drift:.2e}")


if __name__ == "__main__":
    main()
