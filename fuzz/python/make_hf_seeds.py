"""Seeds for the `hf_dir` fuzz target, from the golden tiny models in tests/golden/hf/: per family
and per file, the input `[file selector, family index] + content` that replaces that file with
its own golden content (layout in fuzz/src/hf_scratch.rs).

    python fuzz/python/make_hf_seeds.py tests/golden/hf OUT_DIR        # fuzz/run.sh does this
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

# Keep in step with FAMILIES, FILES and SAFETENSORS_HEADER in fuzz/src/hf_scratch.rs.
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "model.safetensors.index.json"]
SAFETENSORS_HEADER = len(FILES)


def main(golden: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for family_index, family in enumerate(FAMILIES):
        directory = golden / family
        weights = (directory / "model.safetensors").read_bytes()
        (header_len,) = struct.unpack("<Q", weights[:8])
        header = weights[8:8 + header_len]
        contents = {i: (directory / name).read_bytes() for i, name in enumerate(FILES) if (directory / name).is_file()}
        # The whole safetensors file only once (it is large); its header for every family.
        if family != "llama":
            contents.pop(1, None)
        tensor_names = [name for name in json.loads(header) if name != "__metadata__"]
        contents[5] = json.dumps({"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensor_names}}).encode()
        contents[SAFETENSORS_HEADER] = header
        for selector, content in contents.items():
            (out / f"{family}-{selector}").write_bytes(bytes([selector, family_index]) + content)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
